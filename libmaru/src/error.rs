//! The errors of the store, shared by the daemon, the mount and the client.
//!
//! Every error carries an errno so that the control socket and the FUSE mount
//! report the same failure the same way.

use serde::{Deserialize, Serialize};

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of a store operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A name breaks the rules of [`crate::name`].
    #[error("invalid name: {0}")]
    InvalidName(String),
    /// A name component is longer than 255 bytes.
    #[error("name too long: {0}")]
    NameTooLong(String),
    /// No such entry or namespace (or it is still being written).
    #[error("not found: {0}")]
    NotFound(String),
    /// The key is already taken (first writer wins).
    #[error("already exists: {0}")]
    Exists(String),
    /// No pool can hold the request, even after eviction.
    #[error("no space: {0}")]
    NoSpace(String),
    /// A namespace quota would be exceeded.
    #[error("quota exceeded: {0}")]
    Quota(String),
    /// The caller may not do this.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// A sealed entry cannot be changed.
    #[error("entry is sealed and read-only: {0}")]
    ReadOnly(String),
    /// A bad argument (size, handle, pool...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The namespace is not empty.
    #[error("not empty: {0}")]
    NotEmpty(String),
    /// The object is in use.
    #[error("busy: {0}")]
    Busy(String),
    /// The operation is not supported.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection to the daemon is gone.
    #[error("disconnected from marud")]
    Disconnected,
    /// An I/O error.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// An operating-system error the daemon reported: its errno and its text.
    #[error("i/o error: {message}")]
    Os { errno: i32, message: String },
}

impl Error {
    /// The errno that represents this error at the FUSE boundary and on the wire.
    pub fn errno(&self) -> i32 {
        match self {
            Error::InvalidName(_) => libc::EINVAL,
            Error::NameTooLong(_) => libc::ENAMETOOLONG,
            Error::NotFound(_) => libc::ENOENT,
            Error::Exists(_) => libc::EEXIST,
            Error::NoSpace(_) => libc::ENOSPC,
            Error::Quota(_) => libc::EDQUOT,
            Error::PermissionDenied(_) => libc::EACCES,
            Error::ReadOnly(_) => libc::EPERM,
            Error::InvalidArgument(_) => libc::EINVAL,
            Error::NotEmpty(_) => libc::ENOTEMPTY,
            Error::Busy(_) => libc::EBUSY,
            Error::Unsupported(_) => libc::EOPNOTSUPP,
            Error::Protocol(_) => libc::EPROTO,
            Error::Disconnected => libc::ENOTCONN,
            Error::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            Error::Os { errno, .. } => *errno,
        }
    }

    /// A short stable name of the error kind, used on the wire and by `maructl --json`.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidName(_) => "invalid_name",
            Error::NameTooLong(_) => "name_too_long",
            Error::NotFound(_) => "not_found",
            Error::Exists(_) => "exists",
            Error::NoSpace(_) => "no_space",
            Error::Quota(_) => "quota",
            Error::PermissionDenied(_) => "permission_denied",
            Error::ReadOnly(_) => "read_only",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::NotEmpty(_) => "not_empty",
            Error::Busy(_) => "busy",
            Error::Unsupported(_) => "unsupported",
            Error::Protocol(_) => "protocol",
            Error::Disconnected => "disconnected",
            Error::Io(_) | Error::Os { .. } => "io",
        }
    }

    /// What the message says past the kind's own words ("ns/k" of "not found: ns/k"): what
    /// travels on the wire, where the receiver's error adds those words again.
    pub fn detail(&self) -> String {
        match self {
            Error::InvalidName(m)
            | Error::NameTooLong(m)
            | Error::NotFound(m)
            | Error::Exists(m)
            | Error::NoSpace(m)
            | Error::Quota(m)
            | Error::PermissionDenied(m)
            | Error::ReadOnly(m)
            | Error::InvalidArgument(m)
            | Error::NotEmpty(m)
            | Error::Busy(m)
            | Error::Unsupported(m)
            | Error::Protocol(m)
            | Error::Os { message: m, .. } => m.clone(),
            Error::Disconnected => String::new(),
            Error::Io(e) => e.to_string(),
        }
    }

    /// The wire form of this error.
    pub fn to_wire(&self) -> WireError {
        WireError {
            errno: self.errno(),
            kind: self.kind().to_owned(),
            message: self.detail(),
        }
    }

    /// Shorthand for an `io::Error` from an errno.
    pub fn from_errno(errno: i32) -> Self {
        Error::Io(std::io::Error::from_raw_os_error(errno))
    }
}

/// An error as it travels on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// The errno (`ENOENT` = 2 ...).
    pub errno: i32,
    /// A stable kind name (`not_found` ...).
    pub kind: String,
    /// What the error says past its kind's words ([`Error::detail`]): "ns/k" of a
    /// `not_found` whose text is "not found: ns/k".
    pub message: String,
}

impl From<WireError> for Error {
    fn from(w: WireError) -> Self {
        let m = w.message;
        match w.kind.as_str() {
            "invalid_name" => Error::InvalidName(m),
            "name_too_long" => Error::NameTooLong(m),
            "not_found" => Error::NotFound(m),
            "exists" => Error::Exists(m),
            "no_space" => Error::NoSpace(m),
            "quota" => Error::Quota(m),
            "permission_denied" => Error::PermissionDenied(m),
            "read_only" => Error::ReadOnly(m),
            "invalid_argument" => Error::InvalidArgument(m),
            "not_empty" => Error::NotEmpty(m),
            "busy" => Error::Busy(m),
            "unsupported" => Error::Unsupported(m),
            "protocol" => Error::Protocol(m),
            "disconnected" => Error::Disconnected,
            _ => Error::Os {
                errno: w.errno,
                message: m,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind, sent as the daemon sends it (JSON on the wire) and read back as a client
    /// reads it: the text the user sees, the errno and the kind are the sender's.
    #[test]
    fn every_kind_reads_back_as_it_was_sent() {
        let all = [
            Error::InvalidName("a//b".into()),
            Error::NameTooLong("x".repeat(300)),
            Error::NotFound("ns/k".into()),
            Error::Exists("ns/k".into()),
            Error::NoSpace("pool full".into()),
            Error::Quota("ns over 1 GiB".into()),
            Error::PermissionDenied("ns/k: uid 1000".into()),
            Error::ReadOnly("ns/k".into()),
            Error::InvalidArgument("size must be > 0".into()),
            Error::NotEmpty("ns".into()),
            Error::Busy("ticket 3".into()),
            Error::Unsupported("flock".into()),
            Error::Protocol("bad frame".into()),
            Error::Disconnected,
            Error::Io(std::io::Error::from_raw_os_error(libc::EIO)),
            Error::Io(std::io::Error::other("pool file vanished")),
            Error::Os {
                errno: libc::EROFS,
                message: "read-only file system".into(),
            },
        ];
        for e in all {
            let json = serde_json::to_string(&e.to_wire()).unwrap();
            let back = Error::from(serde_json::from_str::<WireError>(&json).unwrap());
            assert_eq!(back.to_string(), e.to_string(), "{json}");
            assert_eq!((back.errno(), back.kind()), (e.errno(), e.kind()), "{json}");
            // The kind's words appear once.
            let words = e.to_string();
            let head = words.split(':').next().unwrap();
            assert_eq!(words.matches(head).count(), 1, "{words}");
        }
    }
}
