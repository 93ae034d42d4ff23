//! The remote tier's control protocol: what a worker and a memory node's marud say to each
//! other over TCP. Only control travels here; the bytes of entries move by one-sided NIXL
//! READ and WRITE between the worker's registered memory and the pool's.
//!
//! A frame is a little-endian `u32` byte count and that many bytes of JSON, as on the local
//! socket; frames over [`MAX_FRAME`] are refused and end the connection. Each request carries
//! the generation of the marud run it was meant for (0 in `hello`); a request for another
//! generation is refused with the kind `stale_generation`, and the worker reconnects. See
//! doc/REMOTE.md.

use std::io::{Read, Write};

use maru::error::WireError;
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// The largest control frame, in bytes.
pub const MAX_FRAME: usize = 1 << 20;
/// The most items (sizes, keys, tickets) in one request.
pub const MAX_ITEMS: usize = 4096;
/// The error kind of a request for another marud run.
pub const STALE_GENERATION: &str = "stale_generation";

/// Bytes that travel as base64 inside JSON (NIXL's agent metadata).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Blob(pub Vec<u8>);

impl Serialize for Blob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine as _;
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use base64::Engine as _;
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map(Blob)
            .map_err(serde::de::Error::custom)
    }
}

/// A request from a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the worker, echoed in the response.
    pub id: u64,
    /// The marud run the worker believes it talks to (0 in `hello`).
    pub generation: u64,
    #[serde(flatten)]
    pub op: Op,
}

/// What a worker asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "snake_case")]
pub enum Op {
    /// The first request: the worker's credentials, name and NIXL agent metadata.
    Hello {
        version: u32,
        /// The shared secret of the deployment ("" for anonymous, where allowed).
        token: String,
        /// The worker's node, for operators.
        node: String,
        /// The worker's NIXL agent metadata, so that marud knows the agent.
        metadata: Blob,
    },
    /// The pool's current NIXL registration (after a region was added).
    Metadata,
    /// Makes namespace `ns` and the namespaces above it that are missing (mode `mode` for
    /// those it makes; `done` when they all exist already).
    Mkdir { ns: String, mode: u32 },
    /// Pages for new entries of namespace `ns`, one per size: all or none. May evict least
    /// recently read entries; fails with `no_space` ("pool full") otherwise.
    Reserve { ns: String, sizes: Vec<u64> },
    /// Publishes reserved pages, written by now, as entries; one outcome per item.
    Publish { ns: String, items: Vec<PublishItem> },
    /// Gives reserved pages back unpublished.
    Abandon { tickets: Vec<u64> },
    /// Reserved pages whose WRITE timed out: kept from every use until the worker abandons
    /// them (its transfer is known over) or the quarantine's TTL ends.
    Quarantine { tickets: Vec<u64> },
    /// Which keys exist.
    Exists { ns: String, keys: Vec<String> },
    /// Finds entries and protects each found from eviction and reuse for the read that
    /// follows, until released or the read TTL ends.
    Lookup { ns: String, keys: Vec<String> },
    /// Ends read protections.
    Release { tickets: Vec<u64> },
    /// Deletes entries; one outcome per key.
    Delete { ns: String, keys: Vec<String> },
    /// Pins or unpins entries (a pinned entry is never evicted); one outcome per key.
    Pin {
        ns: String,
        keys: Vec<String>,
        pinned: bool,
    },
    /// Lists namespace `ns` (`""`: the root) under the policy of a local list: its child
    /// namespaces and entries by name, in order, a page at a time: the names after `after`
    /// (from the first without it) that fit one reply; [`Listing::more`] when names remain.
    /// The pages that continue a listing come from the first page's look at the namespace.
    List {
        ns: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
    },
    /// Liveness.
    Ping,
}

impl Op {
    /// The operation's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Hello { .. } => "hello",
            Op::Metadata => "metadata",
            Op::Mkdir { .. } => "mkdir",
            Op::Reserve { .. } => "reserve",
            Op::Publish { .. } => "publish",
            Op::Abandon { .. } => "abandon",
            Op::Quarantine { .. } => "quarantine",
            Op::Exists { .. } => "exists",
            Op::Lookup { .. } => "lookup",
            Op::Release { .. } => "release",
            Op::Delete { .. } => "delete",
            Op::Pin { .. } => "pin",
            Op::List { .. } => "list",
            Op::Ping => "ping",
        }
    }

    /// How many items it carries.
    pub fn items(&self) -> usize {
        match self {
            Op::Reserve { sizes, .. } => sizes.len(),
            Op::Publish { items, .. } => items.len(),
            Op::Abandon { tickets } | Op::Quarantine { tickets } | Op::Release { tickets } => {
                tickets.len()
            }
            Op::Exists { keys, .. }
            | Op::Lookup { keys, .. }
            | Op::Delete { keys, .. }
            | Op::Pin { keys, .. } => keys.len(),
            Op::Hello { .. } | Op::Metadata | Op::Mkdir { .. } | Op::List { .. } | Op::Ping => 0,
        }
    }
}

/// One reserved page to publish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishItem {
    pub ticket: u64,
    pub key: String,
    /// The entry's length (at most the page's).
    pub len: u64,
}

/// A piece of the pool for one transfer: where it is in marud's registered memory, and the
/// ticket that names the reservation or the read protection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Page {
    pub ticket: u64,
    pub addr: u64,
    pub len: u64,
}

/// The outcome of one publication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Published {
    /// The entry is sealed.
    Created,
    /// The name was taken first by someone else (write-once): the page is freed.
    AlreadyPresent,
    /// Refused (policy, quota, a bad name or ticket): the page is freed.
    Rejected(WireError),
}

/// One page of a namespace's listing (`list`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listing {
    /// Child namespaces: their names in the namespace listed.
    pub children: Vec<String>,
    /// Entries, each in the namespace's pools (one the door does not serve too: such an
    /// entry is listed, and a lookup does not find it).
    pub entries: Vec<Listed>,
    /// Names remain after this page: ask again with `after` = its last name.
    #[serde(default)]
    pub more: bool,
}

/// An entry of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listed {
    pub key: String,
    pub size: u64,
}

/// The pool's memory as NIXL sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// marud's NIXL agent.
    pub agent: String,
    /// Its metadata: what a worker loads to reach the registered memory.
    pub metadata: Blob,
    /// Grows when a region is registered; a worker reloads the metadata when a reply names a
    /// newer version than it loaded.
    pub version: u64,
    /// The registered ranges, as (address, length) in marud's address space.
    pub regions: Vec<(u64, u64)>,
}

/// marud's answer to `hello`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// This marud run.
    pub generation: u64,
    /// The pool's UUID.
    pub pool: String,
    /// Pages are multiples of this many bytes.
    pub page_align: u64,
    /// How long a reservation lives unpublished, and a read protection unreleased.
    pub reserve_ttl_ms: u64,
    pub read_ttl_ms: u64,
    pub quarantine_ttl_ms: u64,
    pub max_items: usize,
    /// The uid and gid the worker acts as.
    pub uid: u32,
    pub gid: u32,
    pub registration: Registration,
}

/// What marud answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", content = "data", rename_all = "snake_case")]
pub enum Reply {
    Hello(Welcome),
    Metadata(Registration),
    Reserved(Vec<Page>),
    Published(Vec<Published>),
    Exists(Vec<bool>),
    Found(Vec<Option<Page>>),
    /// One outcome per key (deletions, pins): `None` when it succeeded.
    Each(Vec<Option<WireError>>),
    Listing(Listing),
    Done,
    Pong,
}

/// A response to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    /// The marud run that answers.
    pub generation: u64,
    /// The registration version (see [`Registration::version`]).
    pub registration: u64,
    pub outcome: Outcome,
}

/// A reply, or why there is none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok(Reply),
    Err(WireError),
}

/// What reading a frame can fail with.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("a frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    TooLarge(usize),
    #[error("bad frame: {0}")]
    Bad(String),
}

/// Writes one message as a frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> std::io::Result<()> {
    let mut out = vec![0u8; 4];
    serde_json::to_writer(&mut out, msg).map_err(std::io::Error::other)?;
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    w.write_all(&out)
}

/// How long a frame begun may take to arrive whole: read timeouts inside a frame (a lost
/// segment's retransmission, say) are waited through, so that the bytes read so far are
/// not lost; a timeout before its first byte is returned (the reader is where it was).
const FRAME_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads one frame's body; `Ok(None)` at a clean end of the stream between frames.
pub fn read_frame(r: &mut impl Read, buf: &mut Vec<u8>) -> Result<Option<()>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    let mut begun = None;
    while got < 4 {
        match read_some(r, &mut len[got..], &mut begun)? {
            Some(0) if got == 0 => return Ok(None),
            Some(0) => return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into()),
            Some(n) => got += n,
            None => {}
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    buf.clear();
    buf.resize(len, 0);
    let mut filled = 0;
    while filled < len {
        match read_some(r, &mut buf[filled..], &mut begun)? {
            Some(0) => return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into()),
            Some(n) => filled += n,
            None => {}
        }
    }
    Ok(Some(()))
}

/// One read of a frame: how many bytes came (`begun` set at the frame's first), or None to
/// read again (interrupted, or a timeout inside a frame begun less than [`FRAME_WITHIN`] ago).
fn read_some(
    r: &mut impl Read,
    into: &mut [u8],
    begun: &mut Option<std::time::Instant>,
) -> std::io::Result<Option<usize>> {
    match r.read(into) {
        Ok(n) => {
            if n > 0 {
                begun.get_or_insert_with(std::time::Instant::now);
            }
            Ok(Some(n))
        }
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(None),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) && begun.is_some_and(|t| t.elapsed() < FRAME_WITHIN) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Decodes a request and checks its shape: the item limit, and no empty batch.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    let req: Request = serde_json::from_slice(body).map_err(|e| FrameError::Bad(e.to_string()))?;
    let n = req.op.items();
    if n > MAX_ITEMS {
        return Err(FrameError::Bad(format!(
            "{} carries {n} items; the limit is {MAX_ITEMS}",
            req.op.name()
        )));
    }
    Ok(req)
}

/// Decodes a response.
pub fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out its bytes in the pieces given, with a read timeout between
    /// each (as a socket with a read timeout does when a segment is late).
    struct Late(std::collections::VecDeque<Vec<u8>>, bool);

    impl Read for Late {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.1 = !self.1;
            if self.1 {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            let Some(mut piece) = self.0.pop_front() else {
                return Ok(0);
            };
            let n = piece.len().min(buf.len());
            buf[..n].copy_from_slice(&piece[..n]);
            if n < piece.len() {
                self.0.push_front(piece.split_off(n));
            }
            Ok(n)
        }
    }

    #[test]
    fn a_timeout_inside_a_frame_loses_nothing() {
        let mut frame = Vec::new();
        write_frame(&mut frame, &"a frame that arrives in pieces").unwrap();
        let pieces = vec![
            frame[..2].to_vec(),
            frame[2..9].to_vec(),
            frame[9..].to_vec(),
        ];
        let mut r = Late(pieces.into(), false);
        let mut body = Vec::new();
        // Before the frame's first byte, the timeout is returned (the connection is idle).
        assert!(matches!(
            read_frame(&mut r, &mut body),
            Err(FrameError::Io(_))
        ));
        assert!(matches!(read_frame(&mut r, &mut body), Ok(Some(()))));
        assert_eq!(
            serde_json::from_slice::<String>(&body).unwrap(),
            "a frame that arrives in pieces"
        );
    }

    fn round_trip(op: Op) {
        let req = Request {
            id: 7,
            generation: 42,
            op,
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &req).unwrap();
        let mut body = Vec::new();
        read_frame(&mut buf.as_slice(), &mut body).unwrap().unwrap();
        assert_eq!(decode_request(&body).unwrap(), req);
    }

    #[test]
    fn every_request_survives_the_wire() {
        round_trip(Op::Hello {
            version: VERSION,
            token: "s3cret".into(),
            node: "gpu-1".into(),
            metadata: Blob(vec![0, 1, 255, 7]),
        });
        round_trip(Op::Metadata);
        round_trip(Op::Mkdir {
            ns: "llama/tp0".into(),
            mode: 0o755,
        });
        round_trip(Op::Reserve {
            ns: "llama".into(),
            sizes: vec![4096, 1 << 25],
        });
        round_trip(Op::Publish {
            ns: "llama".into(),
            items: vec![PublishItem {
                ticket: 3,
                key: "k".into(),
                len: 100,
            }],
        });
        round_trip(Op::Abandon { tickets: vec![1] });
        round_trip(Op::Quarantine { tickets: vec![1] });
        round_trip(Op::Exists {
            ns: "a/b".into(),
            keys: vec!["x".into()],
        });
        round_trip(Op::Lookup {
            ns: "a".into(),
            keys: vec!["x".into(), "y".into()],
        });
        round_trip(Op::Release { tickets: vec![9] });
        round_trip(Op::Delete {
            ns: "a".into(),
            keys: vec![],
        });
        round_trip(Op::Pin {
            ns: "a".into(),
            keys: vec!["x".into()],
            pinned: true,
        });
        round_trip(Op::List {
            ns: "llama".into(),
            after: None,
        });
        round_trip(Op::List {
            ns: "".into(),
            after: Some("k\"7".into()),
        });
        round_trip(Op::Ping);
        // A list without `after` is the first page.
        assert_eq!(
            decode_request(br#"{"id":1,"generation":2,"op":"list","args":{"ns":"a"}}"#)
                .unwrap()
                .op,
            Op::List {
                ns: "a".into(),
                after: None
            }
        );
    }

    #[test]
    fn listings_survive_the_wire() {
        let r = Response {
            id: 4,
            generation: 5,
            registration: 1,
            outcome: Outcome::Ok(Reply::Listing(Listing {
                children: vec!["tp0".into(), "tp1".into()],
                entries: vec![Listed {
                    key: "k1".into(),
                    size: 1 << 20,
                }],
                more: true,
            })),
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &r).unwrap();
        let mut body = Vec::new();
        read_frame(&mut buf.as_slice(), &mut body).unwrap().unwrap();
        assert_eq!(decode_response(&body).unwrap(), r);
        // `more` is false unless said.
        let last = br#"{"id":1,"generation":1,"registration":1,"outcome":{"ok":{"reply":"listing","data":{"children":[],"entries":[]}}}}"#;
        assert_eq!(
            decode_response(last).unwrap().outcome,
            Outcome::Ok(Reply::Listing(Listing::default()))
        );
    }

    #[test]
    fn responses_survive_the_wire() {
        let r = Response {
            id: 1,
            generation: 2,
            registration: 3,
            outcome: Outcome::Ok(Reply::Published(vec![
                Published::Created,
                Published::AlreadyPresent,
                Published::Rejected(maru::Error::Quota("ns over".into()).to_wire()),
            ])),
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &r).unwrap();
        let mut body = Vec::new();
        read_frame(&mut buf.as_slice(), &mut body).unwrap().unwrap();
        assert_eq!(decode_response(&body).unwrap(), r);
    }

    #[test]
    fn oversized_frames_and_batches_are_refused() {
        let mut frame = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        frame.extend([0u8; 16]);
        let mut body = Vec::new();
        assert!(matches!(
            read_frame(&mut frame.as_slice(), &mut body),
            Err(FrameError::TooLarge(_))
        ));
        let big = Request {
            id: 1,
            generation: 1,
            op: Op::Release {
                tickets: vec![0; MAX_ITEMS + 1],
            },
        };
        let big = serde_json::to_vec(&big).unwrap();
        assert!(matches!(decode_request(&big), Err(FrameError::Bad(_))));
        assert!(matches!(
            decode_request(b"{\"id\":1,\"generation\":1,\"op\":\"nope\"}"),
            Err(FrameError::Bad(_))
        ));
        assert!(matches!(
            decode_request(b"{\"id\":1,\"generation\":1,\"op\":\"hello\",\"args\":{\"version\":1,\"token\":\"\",\"node\":\"\",\"metadata\":\"@@\"}}"),
            Err(FrameError::Bad(_))
        ));
        // A stream cut inside a frame is an error, between frames a clean end.
        assert!(read_frame(&mut &[1u8, 0][..], &mut body).is_err());
        assert!(read_frame(&mut &[][..], &mut body).unwrap().is_none());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode_request(&bytes);
            let mut body = Vec::new();
            let _ = read_frame(&mut bytes.as_slice(), &mut body);
        }
    }
}
