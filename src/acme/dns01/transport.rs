//! One DNS exchange with one server: the message over UDP (sent again on
//! silence), over TCP when the answer came back truncated. Bytes and time
//! only; what the answer means is `wire`'s.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use hickory_proto::op::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::{Instant, timeout_at};

/// How long one UDP attempt waits for its answer.
const UDP_WAIT: Duration = Duration::from_millis(1500);
/// UDP attempts before the server counts as unreachable.
const UDP_ATTEMPTS: u32 = 3;
/// The whole exchange, TCP included.
const EXCHANGE_LIMIT: Duration = Duration::from_secs(10);
/// Largest answer read (UDP datagrams, TCP messages).
const MAX_ANSWER: usize = 65_535;

/// Why a server gave no usable answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    /// Nothing came back in time.
    #[error("no answer within {0:?}")]
    Silent(Duration),
    /// The socket failed (refused, unreachable network).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// What came back is not a DNS message.
    #[error("an answer that is not a DNS message: {0}")]
    Garbled(String),
}

/// Sends `message` (already signed, if it is to be) to `server` and
/// returns the answer with the same id.
pub(crate) async fn exchange(
    server: SocketAddr,
    message: &Message,
) -> Result<Message, ExchangeError> {
    let bytes = message
        .to_vec()
        .map_err(|e| ExchangeError::Garbled(format!("cannot encode the question: {e}")))?;
    let id = message.metadata.id;
    let deadline = Instant::now() + EXCHANGE_LIMIT;
    let answer = udp(server, &bytes, id, deadline).await?;
    if answer.metadata.truncation {
        return tcp(server, &bytes, id, deadline).await;
    }
    Ok(answer)
}

async fn udp(
    server: SocketAddr,
    bytes: &[u8],
    id: u16,
    deadline: Instant,
) -> Result<Message, ExchangeError> {
    let local: SocketAddr = if server.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(server).await?;
    let mut buf = vec![0u8; MAX_ANSWER];
    for _ in 0..UDP_ATTEMPTS {
        socket.send(bytes).await?;
        let wait = (Instant::now() + UDP_WAIT).min(deadline);
        loop {
            match timeout_at(wait, socket.recv(&mut buf)).await {
                Err(_) => break,
                Ok(Err(e)) => return Err(e.into()),
                Ok(Ok(n)) => {
                    // Anything else (a late answer to an earlier question,
                    // noise) is not ours: keep waiting.
                    if let Ok(answer) = Message::from_vec(&buf[..n])
                        && answer.metadata.id == id
                    {
                        return Ok(answer);
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Err(ExchangeError::Silent(UDP_WAIT * UDP_ATTEMPTS))
}

async fn tcp(
    server: SocketAddr,
    bytes: &[u8],
    id: u16,
    deadline: Instant,
) -> Result<Message, ExchangeError> {
    let silent = || ExchangeError::Silent(EXCHANGE_LIMIT);
    let work = async {
        let mut stream = TcpStream::connect(server).await?;
        let len = u16::try_from(bytes.len())
            .map_err(|_| ExchangeError::Garbled("a question over 64 KiB".to_owned()))?;
        let mut framed = Vec::with_capacity(bytes.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(bytes);
        stream.write_all(&framed).await?;
        loop {
            let len = usize::from(stream.read_u16().await?);
            let mut buf = vec![0u8; len];
            stream.read_exact(&mut buf).await?;
            let answer =
                Message::from_vec(&buf).map_err(|e| ExchangeError::Garbled(e.to_string()))?;
            if answer.metadata.id == id {
                return Ok(answer);
            }
        }
    };
    timeout_at(deadline, work).await.map_err(|_| silent())?
}
