//! An HTTPS server with an sbmesh node inside: the origins of `sb.yml`
//! get certificates from its ACME CA (self-signed placeholders until
//! then), served on the next handshake with no restart.
//!
//! `EMBED_CONFIG=sb.yml EMBED_STATE_DIR=/tmp/embed EMBED_IP=127.0.0.1 \
//!  EMBED_CHALLENGE_PORT=80 EMBED_HTTPS_PORT=8443 cargo run --example embed`
use std::{env, net::IpAddr, path::PathBuf, sync::Arc, time::Duration};

use sbmesh::tls::{CertResolver, DefaultCertificate, server_config};
use sbmesh::{Node, NodeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The node logs what it does.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .init();
    let var = |name: &str, default: &str| env::var(name).unwrap_or_else(|_| default.into());
    let ip: IpAddr = var("EMBED_IP", "127.0.0.1").parse()?;
    let state = PathBuf::from(var("EMBED_STATE_DIR", "/tmp/sbmesh-embed"));
    let mut cfg = NodeConfig::from_file("embed-0", "embed", var("EMBED_CONFIG", "sb.yml"))?;
    (cfg.bind, cfg.cert_dir, cfg.state_dir) = (ip, state.join("certs"), state);
    cfg.challenge_listen = Some((ip, var("EMBED_CHALLENGE_PORT", "80").parse()?).into());
    let node = Node::start(cfg).await?;

    let resolver = CertResolver::following(node.certificates(), DefaultCertificate::First);
    let tls = tokio_rustls::TlsAcceptor::from(Arc::new(server_config(resolver)?));
    let port: u16 = var("EMBED_HTTPS_PORT", "8443").parse()?;
    let listener = tokio::net::TcpListener::bind((ip, port)).await?;
    println!("serving https://{}", listener.local_addr()?);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(_) => continue, // out of descriptors, mostly: not fatal
            },
            _ = tokio::signal::ctrl_c() => break,
        };
        let tls = tls.clone();
        tokio::spawn(async move {
            let Ok(mut stream) = tls.accept(tcp).await else {
                return;
            };
            let _ = stream.read(&mut [0u8; 4096]).await;
            let reply = "HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n";
            let _ = stream.write_all(reply.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
    node.shutdown(Duration::from_secs(5)).await;
    Ok(())
}
