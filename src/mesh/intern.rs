//! One copy per process of what many mesh structures hold alike: members'
//! names and places, metadata JSON.
//!
//! A member's name reaches a node in every datagram that mentions it, and
//! each decode used to allocate it anew; foca's member list, the metadata
//! map, the ring and the suspicions then each held their own copy. Interned,
//! every holder shares one allocation, and two holders compare equal by
//! pointer first. In a sidecar that saves little (one process, one view of
//! N members); in the simulator, where every core of N shares the process,
//! it is the difference between N² copies and N.
//!
//! Values nobody else holds any more are dropped whenever the table has
//! doubled since it was last swept, so a churning cluster (pods with new
//! names every rollout) does not grow it without end: amortised O(1) per
//! value interned.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// Sweep no table smaller than this.
const MIN_SWEEP: usize = 64;

/// A set of shared values; see the module documentation.
pub(crate) struct Interner<T: ?Sized> {
    table: Mutex<Table<T>>,
}

struct Table<T: ?Sized> {
    set: Option<HashSet<Arc<T>>>,
    /// Sweep when the set reaches this size.
    sweep_at: usize,
}

impl<T: ?Sized + Hash + Eq> Interner<T> {
    /// An empty interner (a `static` one allocates at first use).
    pub(crate) const fn new() -> Self {
        Self {
            table: Mutex::new(Table {
                set: None,
                sweep_at: MIN_SWEEP,
            }),
        }
    }

    /// The shared copy of `value`, which becomes it when there is none.
    pub(crate) fn intern(&self, value: Arc<T>) -> Arc<T> {
        self.get_or_insert(value, |v| v)
    }

    /// The shared copy equal to `value`, made by `into_arc` when there is
    /// none (so work that only a new value needs is done only then).
    pub(crate) fn get_or_insert<V: Borrow<T>>(
        &self,
        value: V,
        into_arc: impl FnOnce(V) -> Arc<T>,
    ) -> Arc<T> {
        // A poisoned lock only means another thread panicked while holding
        // it; the set is whole (an insert does not unwind half-done).
        let mut guard = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let Table { set, sweep_at } = &mut *guard;
        let set = set.get_or_insert_with(HashSet::new);
        if let Some(held) = set.get(value.borrow()) {
            return held.clone();
        }
        let value = into_arc(value);
        set.insert(value.clone());
        if set.len() >= *sweep_at {
            set.retain(|v| Arc::strong_count(v) > 1);
            *sweep_at = (set.len() * 2).max(MIN_SWEEP);
        }
        value
    }

    /// How many values are held (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        let table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        table.set.as_ref().map_or(0, HashSet::len)
    }
}

impl<T: Hash + Eq> Interner<T> {
    /// The shared copy of `value`, allocated only when there is none.
    pub(crate) fn intern_value(&self, value: T) -> Arc<T> {
        self.get_or_insert(value, Arc::new)
    }
}

/// Members' names.
pub(crate) static NAMES: Interner<str> = Interner::new();
/// Metadata records' JSON.
pub(crate) static JSON: Interner<[u8]> = Interner::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_share_one_allocation() {
        let names: Interner<str> = Interner::new();
        let a = names.intern("demo-proxy-0".into());
        let b = names.intern("demo-proxy-0".into());
        assert!(Arc::ptr_eq(&a, &b));
        let c = names.intern("demo-proxy-1".into());
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn values_nobody_holds_are_swept_as_the_table_grows() {
        let names: Interner<str> = Interner::new();
        let kept = names.intern("kept".into());
        for i in 0..10_000 {
            names.intern(format!("gone-{i}").into());
        }
        // Every sweep keeps what is held and whatever came since the last.
        assert!(names.len() < 2 * MIN_SWEEP, "{} held", names.len());
        let again = names.intern("kept".into());
        assert!(Arc::ptr_eq(&kept, &again));
    }

    #[test]
    fn a_value_interned_by_value_is_found_by_arc() {
        let nums: Interner<(u32, u32)> = Interner::new();
        let a = nums.intern_value((1, 2));
        let b = nums.intern(Arc::new((1, 2)));
        assert!(Arc::ptr_eq(&a, &b));
    }
}
