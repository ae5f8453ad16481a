//! One JSON line in, one JSON line out, per connection: how `kiln` talks to `kiln-mgmtd` and
//! how `kiln-mgmtd` talks to its bricks, on Unix sockets. Each kind of socket is one
//! [`LineExchange`]: a limit on a line's length and timeouts for each side, so neither side
//! can be held up or made to buffer without bound by the other.
//!
//! Clients: [`LineExchange::ask`] (tokio) and [`LineExchange::ask_blocking`] (std, for the
//! CLI). Servers (tokio): [`bind_private`], then per connection
//! [`LineExchange::read_request`] and [`LineExchange::write_answer`].
//! A line ends at its newline, or where the peer closes its side.

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};

/// How one kind of socket bounds its exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineExchange {
    /// Longest request or answer line, in bytes, newline excluded.
    pub line_bytes_max: usize,
    /// Server side: how long a request line may take to arrive, and the answer to be taken.
    pub request_timeout: Duration,
    /// Client side: how long the whole exchange may take, the server's work included.
    pub exchange_timeout: Duration,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("not reachable ({0})")]
    Unreachable(#[source] std::io::Error),
    #[error("no answer in time ({} ms)", .0.as_millis())]
    Timeout(Duration),
    #[error("a line longer than {line_bytes_max} bytes")]
    TooLong { line_bytes_max: usize },
    #[error("closed without a line")]
    Closed,
    #[error(transparent)]
    Io(std::io::Error),
    #[error("cannot encode the message: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("malformed message: {0}")]
    Decode(#[source] serde_json::Error),
}

/// Size of each read while looking for the end of a line, in bytes.
const READ_CHUNK_BYTES: usize = 8 * 1024;

impl LineExchange {
    /// This exchange with another client-side timeout (a quick probe, a longer wait).
    pub const fn with_exchange_timeout(self, exchange_timeout: Duration) -> LineExchange {
        LineExchange {
            exchange_timeout,
            ..self
        }
    }

    /// Client: connects to `socket`, sends `request` and reads the answer (tokio).
    pub async fn ask<Q: Serialize, A: DeserializeOwned>(
        &self,
        socket: &Path,
        request: &Q,
    ) -> Result<A, ExchangeError> {
        let line = encode(request, self.line_bytes_max)?;
        let exchange = async {
            let mut stream = tokio::net::UnixStream::connect(socket)
                .await
                .map_err(ExchangeError::Unreachable)?;
            stream.write_all(&line).await.map_err(ExchangeError::Io)?;
            let answer = read_line(&mut stream, self.line_bytes_max).await?;
            decode(&answer)
        };
        match tokio::time::timeout(self.exchange_timeout, exchange).await {
            Ok(answer) => answer,
            Err(_) => Err(ExchangeError::Timeout(self.exchange_timeout)),
        }
    }

    /// Client: [`LineExchange::ask`] on a blocking std socket.
    pub fn ask_blocking<Q: Serialize, A: DeserializeOwned>(
        &self,
        socket: &Path,
        request: &Q,
    ) -> Result<A, ExchangeError> {
        let line = encode(request, self.line_bytes_max)?;
        let deadline = Instant::now() + self.exchange_timeout;
        let mut stream =
            std::os::unix::net::UnixStream::connect(socket).map_err(ExchangeError::Unreachable)?;
        stream
            .set_write_timeout(Some(self.time_left(deadline)?))
            .map_err(ExchangeError::Io)?;
        stream.write_all(&line).map_err(|e| self.timed_out_or(e))?;
        let mut line = LineBuffer::new(self.line_bytes_max);
        let mut chunk = [0u8; READ_CHUNK_BYTES];
        loop {
            stream
                .set_read_timeout(Some(self.time_left(deadline)?))
                .map_err(ExchangeError::Io)?;
            let n = stream.read(&mut chunk).map_err(|e| self.timed_out_or(e))?;
            if n == 0 {
                return decode(&line.finish()?);
            }
            if line.push(&chunk[..n])? {
                return decode(&line.finish()?);
            }
        }
    }

    /// Server: reads one request line from `stream` and decodes it.
    pub async fn read_request<Q: DeserializeOwned>(
        &self,
        stream: &mut tokio::net::UnixStream,
    ) -> Result<Q, ExchangeError> {
        let read = read_line(stream, self.line_bytes_max);
        match tokio::time::timeout(self.request_timeout, read).await {
            Ok(line) => decode(&line?),
            Err(_) => Err(ExchangeError::Timeout(self.request_timeout)),
        }
    }

    /// Server: writes the answer line to `stream`.
    pub async fn write_answer<A: Serialize>(
        &self,
        stream: &mut tokio::net::UnixStream,
        answer: &A,
    ) -> Result<(), ExchangeError> {
        let line = encode(answer, self.line_bytes_max)?;
        match tokio::time::timeout(self.request_timeout, stream.write_all(&line)).await {
            Ok(written) => written.map_err(ExchangeError::Io),
            Err(_) => Err(ExchangeError::Timeout(self.request_timeout)),
        }
    }

    /// What is left until `deadline`; a timeout once nothing is (std refuses a zero timeout).
    fn time_left(&self, deadline: Instant) -> Result<Duration, ExchangeError> {
        Some(deadline.saturating_duration_since(Instant::now()))
            .filter(|left| !left.is_zero())
            .ok_or(ExchangeError::Timeout(self.exchange_timeout))
    }

    /// A blocking socket reports its timeout as `WouldBlock` (or `TimedOut`).
    fn timed_out_or(&self, error: std::io::Error) -> ExchangeError {
        match error.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                ExchangeError::Timeout(self.exchange_timeout)
            }
            _ => ExchangeError::Io(error),
        }
    }
}

/// `message` as one JSON line, newline included.
fn encode<T: Serialize>(message: &T, line_bytes_max: usize) -> Result<Vec<u8>, ExchangeError> {
    let mut line = serde_json::to_vec(message).map_err(ExchangeError::Encode)?;
    if line.len() > line_bytes_max {
        return Err(ExchangeError::TooLong { line_bytes_max });
    }
    line.push(b'\n');
    Ok(line)
}

fn decode<T: DeserializeOwned>(line: &[u8]) -> Result<T, ExchangeError> {
    serde_json::from_slice(line).map_err(ExchangeError::Decode)
}

/// Reads up to the end of one line (tokio).
async fn read_line<R: AsyncRead + Unpin>(
    stream: &mut R,
    line_bytes_max: usize,
) -> Result<Vec<u8>, ExchangeError> {
    let mut line = LineBuffer::new(line_bytes_max);
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    loop {
        let n = stream.read(&mut chunk).await.map_err(ExchangeError::Io)?;
        if n == 0 || line.push(&chunk[..n])? {
            return line.finish();
        }
    }
}

/// The bytes of one line as they arrive, bounded.
struct LineBuffer {
    line: Vec<u8>,
    line_bytes_max: usize,
}

impl LineBuffer {
    fn new(line_bytes_max: usize) -> LineBuffer {
        LineBuffer {
            line: Vec::new(),
            line_bytes_max,
        }
    }

    /// Adds what arrived; true once the newline is in (anything after it is not ours: one
    /// line per connection).
    fn push(&mut self, chunk: &[u8]) -> Result<bool, ExchangeError> {
        let end = chunk.iter().position(|&b| b == b'\n');
        self.line
            .extend_from_slice(&chunk[..end.unwrap_or(chunk.len())]);
        if self.line.len() > self.line_bytes_max {
            return Err(ExchangeError::TooLong {
                line_bytes_max: self.line_bytes_max,
            });
        }
        Ok(end.is_some())
    }

    /// The line; an empty one means the peer closed without sending any.
    fn finish(self) -> Result<Vec<u8>, ExchangeError> {
        match self.line.is_empty() {
            true => Err(ExchangeError::Closed),
            false => Ok(self.line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Ping {
        text: String,
    }

    const TEST: LineExchange = LineExchange {
        line_bytes_max: 1024,
        request_timeout: Duration::from_secs(5),
        exchange_timeout: Duration::from_secs(5),
    };

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// A server that answers each request with its text doubled.
    async fn echo_server(listener: tokio::net::UnixListener, exchange: LineExchange) {
        while let Ok((mut stream, _)) = listener.accept().await {
            let answer = match exchange.read_request::<Ping>(&mut stream).await {
                Ok(ping) => Ping {
                    text: ping.text.repeat(2),
                },
                Err(e) => Ping {
                    text: format!("error: {e}"),
                },
            };
            let _ = exchange.write_answer(&mut stream, &answer).await;
        }
    }

    #[test]
    fn blocking_and_async_clients_round_trip_with_the_async_server() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("s.sock");
        let rt = runtime();
        let listener = rt
            .block_on(async { tokio::net::UnixListener::bind(&socket) })
            .expect("bind");
        rt.spawn(echo_server(listener, TEST));
        let ping = Ping { text: "ab".into() };
        let answer: Ping = TEST.ask_blocking(&socket, &ping).expect("blocking ask");
        assert_eq!(answer.text, "abab");
        let answer: Ping = rt.block_on(TEST.ask(&socket, &ping)).expect("async ask");
        assert_eq!(answer.text, "abab");
        // A request over the limit is refused before it is sent…
        let big = Ping {
            text: "x".repeat(TEST.line_bytes_max),
        };
        let refused = TEST.ask_blocking::<_, Ping>(&socket, &big);
        assert!(matches!(
            refused,
            Err(ExchangeError::TooLong {
                line_bytes_max: 1024
            })
        ));
        // …and a server with a smaller limit refuses it when it arrives.
        let small = LineExchange {
            line_bytes_max: 48,
            ..TEST
        };
        let socket_small = dir.path().join("small.sock");
        let listener = rt
            .block_on(async { tokio::net::UnixListener::bind(&socket_small) })
            .expect("bind");
        rt.spawn(echo_server(listener, small));
        let answer: Ping = TEST
            .ask_blocking(
                &socket_small,
                &Ping {
                    text: "y".repeat(60),
                },
            )
            .expect("an error answer");
        assert_eq!(answer.text, "error: a line longer than 48 bytes");
    }

    #[test]
    fn answers_over_the_limit_and_silence_are_typed_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("s.sock");
        let rt = runtime();
        let listener = rt
            .block_on(async { tokio::net::UnixListener::bind(&socket) })
            .expect("bind");
        // Answers 2 KiB without a newline to the first connection, nothing to the second.
        rt.spawn(async move {
            let (mut first, _) = listener.accept().await.expect("accept");
            let _ = first.write_all(&[b'x'; 2048]).await;
            let (_second, _) = listener.accept().await.expect("accept");
            std::future::pending::<()>().await;
        });
        let ping = Ping { text: "a".into() };
        let long = TEST.ask_blocking::<_, Ping>(&socket, &ping);
        assert!(
            matches!(long, Err(ExchangeError::TooLong { .. })),
            "{long:?}"
        );
        let quick = TEST.with_exchange_timeout(Duration::from_millis(100));
        let silent = rt.block_on(quick.ask::<_, Ping>(&socket, &ping));
        assert!(
            matches!(silent, Err(ExchangeError::Timeout(_))),
            "{silent:?}"
        );
        let nobody = TEST.ask_blocking::<_, Ping>(&dir.path().join("none.sock"), &ping);
        assert!(
            matches!(nobody, Err(ExchangeError::Unreachable(_))),
            "{nobody:?}"
        );
    }

    #[test]
    fn a_blocking_client_times_out_and_a_server_stops_waiting_for_a_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("s.sock");
        let rt = runtime();
        let listener = rt
            .block_on(async { tokio::net::UnixListener::bind(&socket) })
            .expect("bind");
        let quick = TEST.with_exchange_timeout(Duration::from_millis(100));
        let server = LineExchange {
            request_timeout: Duration::from_millis(100),
            ..TEST
        };
        let served = rt.spawn(async move {
            // The first client never answers in time; the second never sends.
            let (_first, _) = listener.accept().await.expect("accept");
            let (mut second, _) = listener.accept().await.expect("accept");
            server.read_request::<Ping>(&mut second).await
        });
        let silent = quick.ask_blocking::<_, Ping>(&socket, &Ping { text: "a".into() });
        assert!(
            matches!(silent, Err(ExchangeError::Timeout(_))),
            "{silent:?}"
        );
        let _idle = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        let request = rt.block_on(served).expect("server task");
        assert!(
            matches!(request, Err(ExchangeError::Timeout(_))),
            "{request:?}"
        );
    }

    #[test]
    fn a_line_ends_at_its_newline_or_at_the_close() {
        let mut line = LineBuffer::new(8);
        assert!(!line.push(b"{\"a\"").expect("fits"));
        assert!(line.push(b":1}\nrest").expect("fits"));
        assert_eq!(line.finish().expect("line"), b"{\"a\":1}");
        let mut closed = LineBuffer::new(8);
        assert!(!closed.push(b"12345678").expect("exactly the limit fits"));
        assert_eq!(closed.finish().expect("line"), b"12345678");
        assert!(matches!(
            LineBuffer::new(8).push(b"123456789\n"),
            Err(ExchangeError::TooLong { line_bytes_max: 8 })
        ));
        assert!(matches!(
            LineBuffer::new(8).finish(),
            Err(ExchangeError::Closed)
        ));
    }
}

/// Why a private socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("cannot create {}: {source}", .dir.display())]
    Directory {
        dir: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is open to other users (mode {mode:04o}): a socket there could be reached before \
         its own mode is set; make the directory 0700",
        .dir.display()
    )]
    OpenDirectory { dir: std::path::PathBuf, mode: u32 },
    #[error("cannot listen on {}: {source}", .path.display())]
    Bind {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// Binds a root-only control socket at `path`: its directory is made 0700 when missing and
/// refused when other users can reach into it, so the socket is never reachable by them, not
/// even between its creation and its chmod to 0600. A stale socket is replaced.
pub fn bind_private(path: &Path) -> Result<tokio::net::UnixListener, BindError> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let dir_error = |source| BindError::Directory {
        dir: dir.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(dir_error)?;
    let mode = std::fs::metadata(dir).map_err(dir_error)?.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(BindError::OpenDirectory {
            dir: dir.to_owned(),
            mode,
        });
    }
    let bind_error = |source| BindError::Bind {
        path: path.to_owned(),
        source,
    };
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).map_err(bind_error)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_error)?;
    Ok(listener)
}

#[cfg(test)]
mod bind_tests {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    use super::*;

    #[tokio::test]
    async fn private_sockets_live_in_private_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fresh = dir.path().join("run/kiln.sock");
        bind_private(&fresh).expect("a new 0700 directory");
        let meta = |p: &Path| std::fs::metadata(p).expect("stat").mode() & 0o777;
        assert_eq!(meta(&dir.path().join("run")), 0o700);
        assert_eq!(meta(&fresh), 0o600);
        bind_private(&fresh).expect("a stale socket is replaced");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let refused = bind_private(&open.join("x.sock")).expect_err("an open directory");
        assert!(refused.to_string().contains("mode 0755"), "{refused}");
    }
}
