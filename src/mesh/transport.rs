//! The mesh's TCP transport: inbound connections admitted under limits
//! (a first frame within `FIRST_FRAME_TIMEOUT`, at most
//! `MAX_UNAUTHENTICATED` unauthenticated, `MAX_INBOUND_EXCHANGES` served at
//! once), push-pull and metadata exchanges answered through the driver's
//! commands, and the outbound exchanges the driver starts.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::mesh::runtime::{Command, now_ms};
use crate::mesh::seal::{Reject, Sealer};
use crate::mesh::wire::{self, FullState, TcpMsg, WireError};
use crate::metrics::{Metrics, Transport};

/// One TCP exchange, connect to last byte.
const TCP_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an inbound transport connection may take to deliver its whole
/// first frame. A peer writes it right after connecting (at most
/// [`wire::MAX_REQUEST_FRAME`], milliseconds on a LAN), so a connection
/// that has not is idle or trickling, and only holds a slot.
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(2);
/// Inbound connections whose first frame has not opened yet, in all. With
/// [`wire::MAX_REQUEST_FRAME`] this bounds what unauthenticated peers can
/// make us buffer to 64 MiB (a few KiB while they stall).
const MAX_UNAUTHENTICATED: usize = 64;
/// The same, per source (an IPv4 address, an IPv6 /64: what one host
/// gets), so one source cannot take all the slots.
const MAX_UNAUTHENTICATED_PER_SOURCE: usize = 8;
/// Authenticated inbound exchanges served at once; more wait their turn.
const MAX_INBOUND_EXCHANGES: usize = 64;
/// Refused connections are logged at most this often (with a count).
const REFUSED_WARN_EVERY: Duration = Duration::from_secs(10);

/// Inbound connections still in the unauthenticated phase, oldest first.
///
/// At a limit one of them (of the source, else overall) is closed to make
/// room: the oldest that has sent nothing yet, else the oldest. A peer
/// writes its first frame right after connecting, so one with bytes waiting
/// is a peer whose task has not run yet (a busy node accepts a burst before
/// it serves any), and the oldest silent one is all but always idle;
/// refusing the newest instead would let anyone holding idle connections
/// lock every peer out.
#[derive(Default)]
struct Unauthenticated {
    next_id: u64,
    /// By the order of arrival.
    conns: std::collections::BTreeMap<u64, Waiting>,
}

/// One connection in [`Unauthenticated`].
struct Waiting {
    source: IpAddr,
    /// A second handle on the socket, to look at what waits in its receive
    /// queue without taking it (none: counted as silent).
    probe: Option<std::net::TcpStream>,
    close: oneshot::Sender<()>,
}

impl Waiting {
    /// Whether bytes from the peer wait to be read: its first frame.
    fn has_sent(&self) -> bool {
        self.probe
            .as_ref()
            .is_some_and(|p| matches!(p.peek(&mut [0u8; 1]), Ok(n) if n > 0))
    }
}

impl Unauthenticated {
    /// Closes a connection if one must go before one more from `source` is
    /// admitted; returns the reason. A connection whose first frame opened
    /// meanwhile has left the table, or ignores the signal: only the
    /// unauthenticated phase can be cut short.
    fn make_room(&mut self, source: IpAddr) -> Option<&'static str> {
        let of_source = self.conns.values().filter(|w| w.source == source).count();
        let (reason, id) = if of_source >= MAX_UNAUTHENTICATED_PER_SOURCE {
            ("source_limit", self.victim(|w| w.source == source)?)
        } else if self.conns.len() >= MAX_UNAUTHENTICATED {
            ("limit", self.victim(|_| true)?)
        } else {
            return None;
        };
        let gone = self.conns.remove(&id)?;
        let _ = gone.close.send(());
        Some(reason)
    }

    /// The oldest connection `among` that has sent nothing, else the oldest.
    fn victim(&self, among: impl Fn(&Waiting) -> bool) -> Option<u64> {
        let mut oldest = None;
        for (&id, w) in self.conns.iter().filter(|(_, w)| among(w)) {
            oldest.get_or_insert(id);
            if !w.has_sent() {
                return Some(id);
            }
        }
        oldest
    }

    /// Registers a new connection (`probe`: see [`Waiting::probe`]); the
    /// receiver fires when it must close.
    fn admit(
        &mut self,
        source: IpAddr,
        probe: Option<std::net::TcpStream>,
    ) -> (u64, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id;
        self.next_id += 1;
        self.conns.insert(
            id,
            Waiting {
                source,
                probe,
                close: tx,
            },
        );
        (id, rx)
    }
}

/// The source a connection counts against: its IPv4 address (also when
/// mapped into IPv6), else its IPv6 /64.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from_bits(
                v6.to_bits() & !((1u128 << 64) - 1),
            )),
        },
    }
}

/// Takes a connection out of [`Unauthenticated`] when its first frame is
/// done with.
struct Admitted {
    table: Arc<std::sync::Mutex<Unauthenticated>>,
    id: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        lock(&self.table).conns.remove(&self.id);
    }
}

fn lock(table: &std::sync::Mutex<Unauthenticated>) -> std::sync::MutexGuard<'_, Unauthenticated> {
    // The table stays consistent whatever panicked while holding it.
    table
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A warning at most every [`REFUSED_WARN_EVERY`], with how many were held back.
struct RefusedLog {
    last: std::sync::Mutex<Option<Instant>>,
    held_back: std::sync::atomic::AtomicU64,
}

impl RefusedLog {
    /// Counts and logs a connection closed before it authenticated.
    fn refused(&self, metrics: &Metrics, peer: SocketAddr, reason: &'static str) {
        metrics.mesh.connection_refused(reason);
        self.warn(
            peer,
            reason,
            "transport connection closed before it authenticated (idle, too slow, or too many \
             from one source); see mesh_transport_connections_refused_total",
        );
    }

    /// Logs a first frame that did not open (counted by the caller in
    /// `mesh_packets_rejected_total`).
    fn rejected(&self, peer: SocketAddr, reason: &'static str) {
        self.warn(
            peer,
            reason,
            "transport connection closed: its first frame was rejected (too large, another \
             cluster, an unknown key, stale or replayed); see mesh_packets_rejected_total",
        );
    }

    fn warn(&self, peer: SocketAddr, reason: &'static str, message: &'static str) {
        let now = Instant::now();
        let due = {
            let mut last = self
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = last.is_none_or(|t| now.duration_since(t) >= REFUSED_WARN_EVERY);
            if due {
                *last = Some(now);
            }
            due
        };
        if due {
            let held_back = self.held_back.swap(0, Ordering::Relaxed);
            warn!(%peer, reason, held_back, "{message}");
        } else {
            self.held_back.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub(super) async fn accept_loop(
    listener: TcpListener,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    cmd: mpsc::Sender<Command>,
) {
    let table = Arc::new(std::sync::Mutex::new(Unauthenticated::default()));
    let exchanges = Arc::new(tokio::sync::Semaphore::new(MAX_INBOUND_EXCHANGES));
    let log = Arc::new(RefusedLog {
        last: std::sync::Mutex::new(None),
        held_back: std::sync::atomic::AtomicU64::new(0),
    });
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "transport accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let source = source_of(peer.ip());
        // A duplicate descriptor, closed when the connection leaves the table.
        let probe = std::os::fd::AsFd::as_fd(&stream)
            .try_clone_to_owned()
            .ok()
            .map(std::net::TcpStream::from);
        let (made_room, (id, closed)) = {
            let mut t = lock(&table);
            (t.make_room(source), t.admit(source, probe))
        };
        if let Some(reason) = made_room {
            log.refused(&metrics, peer, reason);
        }
        let admitted = Admitted {
            table: table.clone(),
            id,
        };
        let (sealer, metrics, cmd) = (sealer.clone(), metrics.clone(), cmd.clone());
        let (exchanges, log) = (exchanges.clone(), log.clone());
        tokio::spawn(async move {
            let first = (admitted, closed);
            serve_conn(
                stream, peer, first, &sealer, &metrics, &cmd, &exchanges, &log,
            )
            .await
        });
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_conn(
    mut stream: TcpStream,
    peer: SocketAddr,
    (admitted, closed): (Admitted, oneshot::Receiver<()>),
    sealer: &Sealer,
    metrics: &Metrics,
    cmd: &mpsc::Sender<Command>,
    exchanges: &tokio::sync::Semaphore,
    log: &RefusedLog,
) {
    let first = tokio::select! {
        // A frame already received is served even when a close was asked
        // for before this task first ran.
        biased;
        first = tokio::time::timeout(
            FIRST_FRAME_TIMEOUT,
            wire::read_frame(&mut stream, sealer, wire::MAX_REQUEST_FRAME, now_ms),
        ) => first,
        // Closed to make room (counted by the accept loop).
        _ = closed => return,
    };
    drop(admitted);
    let (msg, n, key_id) = match first {
        Ok(Ok(frame)) => frame,
        Ok(Err(WireError::Rejected(r))) => {
            metrics.mesh.rejected(r.label());
            log.rejected(peer, r.label());
            return;
        }
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "transport exchange failed");
            return;
        }
        Err(_) => {
            log.refused(metrics, peer, "timeout");
            return;
        }
    };
    metrics.mesh.received(Transport::tcp, n);
    let answer = async {
        let _permit = exchanges.acquire().await.map_err(|_| WireError::Timeout)?;
        answer(&mut stream, msg, key_id, sealer, metrics, cmd).await
    };
    match tokio::time::timeout(TCP_TIMEOUT, answer).await {
        Ok(Ok(())) => {}
        Ok(Err(WireError::Rejected(r))) => {
            metrics.mesh.rejected(r.label());
            debug!(%peer, reason = r.label(), "transport frame rejected");
        }
        Ok(Err(e)) => debug!(%peer, error = %e, "transport exchange failed"),
        Err(_) => debug!(%peer, "transport exchange timed out"),
    }
}

/// Answers one authenticated request.
async fn answer(
    stream: &mut TcpStream,
    msg: TcpMsg,
    key_id: u32,
    sealer: &Sealer,
    metrics: &Metrics,
    cmd: &mpsc::Sender<Command>,
) -> Result<(), WireError> {
    let reply = match msg {
        TcpMsg::PushPull(state) => {
            let (tx, rx) = oneshot::channel();
            cmd.send(Command::PushPullIn(state, tx))
                .await
                .map_err(|_| WireError::Timeout)?;
            TcpMsg::PushPull(rx.await.map_err(|_| WireError::Timeout)?)
        }
        TcpMsg::MetaRequest(node_id) => {
            let (tx, rx) = oneshot::channel();
            cmd.send(Command::MetaIn(node_id, tx))
                .await
                .map_err(|_| WireError::Timeout)?;
            TcpMsg::MetaReply(rx.await.map_err(|_| WireError::Timeout)?)
        }
        TcpMsg::MetaReply(_) => return Err(WireError::Rejected(Reject::Decode)),
    };
    let n = wire::write_frame(stream, sealer, Some(key_id), &reply, now_ms()).await?;
    metrics.mesh.sent(Transport::tcp, n);
    Ok(())
}

async fn exchange(
    (addr, key): (SocketAddr, Option<u32>),
    msg: TcpMsg,
    sealer: &Sealer,
    metrics: &Metrics,
) -> Result<TcpMsg, WireError> {
    let run = async {
        let mut stream = TcpStream::connect(addr).await?;
        let n = wire::write_frame(&mut stream, sealer, key, &msg, now_ms()).await?;
        metrics.mesh.sent(Transport::tcp, n);
        let (reply, n, _) =
            wire::read_frame(&mut stream, sealer, wire::MAX_REPLY_FRAME, now_ms).await?;
        metrics.mesh.received(Transport::tcp, n);
        Ok(reply)
    };
    match tokio::time::timeout(TCP_TIMEOUT, run).await {
        Ok(r) => {
            if let Err(WireError::Rejected(reason)) = &r {
                metrics.mesh.rejected(reason.label());
            }
            r
        }
        Err(_) => Err(WireError::Timeout),
    }
}

pub(super) async fn push_pull(
    (addr, key): (SocketAddr, Option<u32>),
    state: FullState,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    cmd: mpsc::WeakSender<Command>,
) {
    match exchange((addr, key), TcpMsg::PushPull(state), &sealer, &metrics).await {
        Ok(TcpMsg::PushPull(remote)) => {
            if let Some(cmd) = cmd.upgrade() {
                let _ = cmd.send(Command::PushPullDone(remote)).await;
            }
        }
        Ok(_) => metrics.mesh.rejected(Reject::Decode.label()),
        Err(e) => debug!(%addr, error = %e, "full-state exchange failed"),
    }
}

pub(super) async fn fetch_meta(
    (addr, key): (SocketAddr, Option<u32>),
    node_id: String,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    cmd: mpsc::WeakSender<Command>,
) {
    let rec = match exchange(
        (addr, key),
        TcpMsg::MetaRequest(node_id.clone()),
        &sealer,
        &metrics,
    )
    .await
    {
        Ok(TcpMsg::MetaReply(rec)) => rec.filter(|r| *r.node_id == *node_id),
        Ok(_) => None,
        Err(e) => {
            debug!(%addr, error = %e, "metadata fetch failed");
            None
        }
    };
    if let Some(cmd) = cmd.upgrade() {
        let _ = cmd.send(Command::MetaFetched(rec, node_id)).await;
    }
}

#[cfg(test)]
mod transport_limit_tests {
    //! Who is closed when the unauthenticated phase is full.

    use super::*;
    use std::io::Write;

    fn ip(a: u8, b: u8) -> IpAddr {
        IpAddr::from([10, 0, a, b])
    }

    #[test]
    fn an_ipv6_source_is_its_64_and_a_mapped_ipv4_its_address() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(other));
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(source_of(mapped), IpAddr::from([10, 0, 0, 7]));
    }

    #[test]
    fn the_oldest_of_a_full_source_makes_room_then_the_oldest_overall() {
        let mut t = Unauthenticated::default();
        let mut closed = Vec::new();
        for _ in 0..MAX_UNAUTHENTICATED_PER_SOURCE {
            closed.push(t.admit(ip(0, 1), None));
        }
        // Another source is not affected by 10.0.0.1 being full.
        assert_eq!(t.make_room(ip(0, 2)), None);
        assert_eq!(t.make_room(ip(0, 1)), Some("source_limit"));
        let (oldest, mut signal) = closed.remove(0);
        assert_eq!(
            signal.try_recv(),
            Ok(()),
            "the oldest of 10.0.0.1 is told to close"
        );
        assert!(!t.conns.contains_key(&oldest));
        assert!(closed.iter_mut().all(|(_, s)| s.try_recv().is_err()));

        // Fill up from many sources: the oldest overall goes.
        let mut b = 0u8;
        while t.conns.len() < MAX_UNAUTHENTICATED {
            b += 1;
            closed.push(t.admit(ip(1, b), None));
        }
        assert_eq!(t.make_room(ip(2, 1)), Some("limit"));
        let (oldest, signal) = &mut closed[0];
        assert_eq!(
            signal.try_recv(),
            Ok(()),
            "the oldest overall is told to close"
        );
        assert!(!t.conns.contains_key(oldest));
    }

    #[test]
    fn a_connection_whose_first_frame_waits_is_not_closed_for_a_silent_one() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let source = IpAddr::from([127, 0, 0, 1]);
        let mut t = Unauthenticated::default();
        let mut clients = Vec::new();
        let mut signals = Vec::new();
        // A client and its accepted end, admitted with a probe.
        let connect = |t: &mut Unauthenticated| {
            let client = std::net::TcpStream::connect(addr).unwrap();
            let (accepted, _) = listener.accept().unwrap();
            // As tokio's sockets are: the probe shares the flag.
            accepted.set_nonblocking(true).unwrap();
            let probe = accepted.try_clone().unwrap();
            (client, (t.admit(source, Some(probe)), accepted))
        };
        for _ in 0..MAX_UNAUTHENTICATED_PER_SOURCE {
            let (client, signal) = connect(&mut t);
            clients.push(client);
            signals.push(signal);
        }
        // The oldest is a peer whose frame arrived before its task ran.
        clients[0].write_all(b"frame").unwrap();
        let waits =
            |s: &std::net::TcpStream| poll(|| matches!(s.peek(&mut [0u8; 1]), Ok(n) if n > 0));
        assert!(waits(&signals[0].1), "the peer's bytes arrived");
        assert_eq!(t.make_room(source), Some("source_limit"));
        assert!(
            signals[0].0.1.try_recv().is_err(),
            "the connection with a frame waiting is kept"
        );
        assert_eq!(
            signals[1].0.1.try_recv(),
            Ok(()),
            "the oldest silent connection is told to close"
        );

        // When every one has sent something, the oldest goes.
        let (client, signal) = connect(&mut t);
        clients.push(client);
        signals.push(signal);
        for i in (2..clients.len()).rev() {
            clients[i].write_all(b"x").unwrap();
            assert!(waits(&signals[i].1));
        }
        assert_eq!(t.make_room(source), Some("source_limit"));
        assert_eq!(
            signals[0].0.1.try_recv(),
            Ok(()),
            "with every one waiting to be read, the oldest is told to close"
        );
    }

    /// Polls `f` for up to 5 s.
    fn poll(f: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }
}
