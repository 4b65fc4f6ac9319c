//! Where the sidecar and the proxy would fight over the same thing: the
//! proxy's own mesh (`proxy.cluster`) binding the sidecar's ports, and the
//! proxy's own ACME client (`proxy.acme.enabled`) ordering the hostnames the
//! sidecar orders.

use super::{Problem, SbConfig};

/// The ports the sidecar's mesh will bind, once flags, environment, the
/// sidecar's block and the defaults are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SidecarPorts {
    /// UDP gossip.
    pub gossip: u16,
    /// TCP transport.
    pub transport: u16,
}

/// The conflicts of `config` with a sidecar that binds `ports`; each
/// problem names both settings and the fix.
pub fn config_conflicts(config: &SbConfig, ports: SidecarPorts) -> Vec<Problem> {
    let mut problems = Vec::new();
    if let Some(cluster) = &config.proxy.cluster {
        let mut clash =
            |proxy_port: u16, ours: u16, key: &str, proto: &str, flag: &str, env: &str| {
                if proxy_port == ours {
                    problems.push(Problem::error(
                    format!("proxy.cluster.{key}"),
                    format!(
                        "sbproxy's own mesh (proxy.cluster) binds {proto} {proxy_port}, the same \
                         port as the sidecar's {key} (proxy.extensions.sbmesh.{key} / {flag} / \
                         {env}); both run in the pod's network, so one of them cannot start. \
                         Remove proxy.cluster and let the sidecar form the mesh, or give one of \
                         them another port"
                    ),
                ));
                }
            };
        clash(
            cluster.gossip_port,
            ports.gossip,
            "gossip_port",
            "UDP",
            "--gossip-port",
            "SBMESH_GOSSIP_PORT",
        );
        clash(
            cluster.transport_port,
            ports.transport,
            "transport_port",
            "TCP",
            "--transport-port",
            "SBMESH_TRANSPORT_PORT",
        );
    }
    if config.proxy.acme.as_ref().is_some_and(|a| a.enabled) && config.acme_enabled() {
        problems.push(Problem::error(
            "proxy.acme.enabled",
            "true while the sidecar's ACME (proxy.extensions.sbmesh.acme.enabled) is on too: \
             sbproxy would order the same hostnames itself, in every pod. Set \
             proxy.acme.enabled: false (or remove proxy.acme) to let the sidecar issue for the \
             whole fleet, or set proxy.extensions.sbmesh.acme.enabled: false",
        ));
    }
    problems
}
