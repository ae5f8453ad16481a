//! The client's errors: every one maps to the errno a local file system call would give.

use kiln_wire::ErrorCode;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The brick ran the fop and it failed, as it would on a local file system.
    #[error("{}", errno_text(.0.to_errno()))]
    Fop(ErrorCode),
    /// The connection broke while this call was in flight: it may or may not have run. The
    /// next call reconnects.
    #[error("connection to the brick lost: {0}")]
    Disconnected(String),
    /// No connection could be made (brick down, wrong address, TLS handshake refused).
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    /// The brick closed the connection and said why (auth.allow, protocol version).
    #[error("the brick refused the connection: {0}")]
    Refused(String),
    /// The brick answered something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The client's TLS material could not be loaded or used.
    #[error("TLS: {0}")]
    Tls(String),
    /// A layer of the client stack was called against its contract (an fd fop through
    /// `Layer::call`, say): a bug in the caller, never something the brick did.
    #[error("client stack misuse: {0}")]
    Misuse(String),
}

impl Error {
    /// The errno a POSIX caller (a FUSE reply, a shell message) gets for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Fop(code) => code.to_errno(),
            Error::Disconnected(_) => libc::ENOTCONN,
            Error::Connect { .. } => libc::ECONNREFUSED,
            Error::Refused(_) => libc::EACCES,
            Error::Protocol(_) => libc::EPROTO,
            Error::Tls(_) => libc::EACCES,
            Error::Misuse(_) => libc::EINVAL,
        }
    }

    /// The brick's error code, when the fop itself failed.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Fop(code) => Some(*code),
            _ => None,
        }
    }
}

impl From<ErrorCode> for Error {
    fn from(code: ErrorCode) -> Error {
        Error::Fop(code)
    }
}

/// The C library's text for `errno`, e.g. "No such file or directory".
pub fn errno_text(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    // std appends " (os error N)"; coreutils prints the bare text.
    match text.rfind(" (os error") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fop_errors_read_like_coreutils() {
        assert_eq!(
            Error::Fop(ErrorCode::from_errno(libc::ENOENT)).to_string(),
            "No such file or directory"
        );
        assert_eq!(
            Error::Fop(ErrorCode::from_errno(libc::EEXIST)).errno(),
            libc::EEXIST
        );
        assert_eq!(Error::Disconnected("x".into()).errno(), libc::ENOTCONN);
    }
}
