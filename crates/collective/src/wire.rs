//! Length-prefixed frames, a checked binary codec, and the `Hello` handshake every connection
//! opens with.
//!
//! Every frame is `u32 little-endian length | payload`. Decoding never trusts a length: a frame
//! longer than the reader's limit is refused before anything is allocated, and every field read
//! is bounds-checked, so hostile or truncated bytes become a [`WireError`], never a panic.

use std::io::{self, Read, Write};
use std::net::TcpStream;

use crate::CollectiveError;

/// The largest control frame accepted (store keys and values, handshakes).
pub(crate) const MAX_CONTROL_FRAME: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection closed by the peer in the middle of a frame")]
    Truncated,
    #[error(
        "frame of {len} bytes exceeds the limit of {limit} bytes (not a trainctl peer, or a corrupt stream)"
    )]
    TooLarge { len: usize, limit: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Writes one frame.
pub(crate) fn write_frame(w: &mut impl Write, payload: &[u8]) -> Result<(), WireError> {
    let len = u32::try_from(payload.len()).map_err(|_| WireError::TooLarge {
        len: payload.len(),
        limit: u32::MAX as usize,
    })?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame. `Ok(None)` on a clean end of stream before the first byte.
pub fn read_frame(r: &mut impl Read, limit: usize) -> Result<Option<Vec<u8>>, WireError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(WireError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > limit {
        return Err(WireError::TooLarge { len, limit });
    }
    let mut buf = vec![0u8; len];
    read_exact(r, &mut buf)?;
    Ok(Some(buf))
}

/// `read_exact` that reports a vanished peer as [`WireError::Truncated`].
pub fn read_exact(r: &mut impl Read, buf: &mut [u8]) -> Result<(), WireError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => WireError::Truncated,
        _ => WireError::Io(e),
    })
}

/// Appends fields to a message buffer.
#[derive(Default)]
pub(crate) struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    pub(crate) fn new() -> Self {
        Self::default()
    }
    pub(crate) fn u8(mut self, v: u8) -> Self {
        self.buf.push(v);
        self
    }
    pub(crate) fn u32(mut self, v: u32) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn i64(mut self, v: i64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn bytes(self, v: &[u8]) -> Self {
        let mut this = self.u32(v.len() as u32);
        this.buf.extend_from_slice(v);
        this
    }
    pub(crate) fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads fields from a message, every read bounds-checked.
pub(crate) struct Decoder<'a> {
    buf: &'a [u8],
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Malformed(format!(
                "{what}: needs {n} bytes, {} left",
                self.buf.len()
            )));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or([0; 4]),
        ))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or([0; 8]),
        ))
    }
    pub(crate) fn i64(&mut self, what: &str) -> Result<i64, WireError> {
        Ok(i64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or([0; 8]),
        ))
    }
    pub(crate) fn bytes(&mut self, what: &str) -> Result<&'a [u8], WireError> {
        let len = self.u32(what)? as usize;
        self.take(len, what)
    }
    pub(crate) fn string(&mut self, what: &str) -> Result<String, WireError> {
        let raw = self.bytes(what)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| WireError::Malformed(format!("{what}: not valid UTF-8")))
    }
    /// Fails when bytes are left over: a message is exactly its fields.
    pub(crate) fn end(&self, what: &str) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::Malformed(format!(
                "{what}: {} unexpected trailing bytes",
                self.buf.len()
            )))
        }
    }
}

/// What a connecting peer says first. The acceptor checks run id and token and answers with
/// [`HandshakeReply`]; nothing else is read from a peer that has not passed this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub run_id: String,
    pub token: String,
    pub rank: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    StoreClient = 1,
    RingPeer = 2,
}

const HELLO_MAGIC: &[u8; 4] = b"TCTL";
pub(crate) const PROTOCOL_VERSION: u32 = 1;

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        for b in HELLO_MAGIC {
            e = e.u8(*b);
        }
        e.u32(PROTOCOL_VERSION)
            .u8(self.role as u8)
            .str(&self.run_id)
            .str(&self.token)
            .u32(self.rank)
            .finish()
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut d = Decoder::new(buf);
        let magic = d.take(4, "handshake magic")?;
        if magic != HELLO_MAGIC {
            return Err(WireError::Malformed(
                "not a trainctl handshake (bad magic bytes)".into(),
            ));
        }
        let version = d.u32("protocol version")?;
        if version != PROTOCOL_VERSION {
            return Err(WireError::Malformed(format!(
                "protocol version {version}, this trainctl speaks {PROTOCOL_VERSION}: run the same trainctl version on every node"
            )));
        }
        let role = match d.u8("role")? {
            1 => Role::StoreClient,
            2 => Role::RingPeer,
            other => return Err(WireError::Malformed(format!("unknown role {other}"))),
        };
        let hello = Hello {
            role,
            run_id: d.string("run id")?,
            token: d.string("token")?,
            rank: d.u32("rank")?,
        };
        d.end("handshake")?;
        Ok(hello)
    }
}

/// The acceptor's answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeReply {
    Accepted,
    Refused(String),
}

impl HandshakeReply {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            HandshakeReply::Accepted => Encoder::new().u8(0).finish(),
            HandshakeReply::Refused(why) => Encoder::new().u8(1).str(why).finish(),
        }
    }
    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut d = Decoder::new(buf);
        let reply = match d.u8("handshake reply")? {
            0 => HandshakeReply::Accepted,
            1 => HandshakeReply::Refused(d.string("refusal reason")?),
            other => {
                return Err(WireError::Malformed(format!(
                    "unknown handshake reply {other}"
                )));
            }
        };
        d.end("handshake reply")?;
        Ok(reply)
    }
}

/// Reads the peer's hello and answers it; `Ok(hello)` only when run id and token match.
pub(crate) fn accept_handshake(
    stream: &mut TcpStream,
    run_id: &str,
    token: &str,
    expect: Role,
) -> Result<Hello, CollectiveError> {
    let frame = read_frame(stream, 4096)?.ok_or(WireError::Truncated)?;
    let hello = Hello::decode(&frame)?;
    let refusal = if hello.run_id != run_id {
        Some(format!(
            "run id mismatch: this side is in run {run_id:?}, the peer in run {:?}",
            hello.run_id
        ))
    } else if hello.token != token {
        Some(format!(
            "job token mismatch for run {run_id:?}: the peer was not started by this job's launcher"
        ))
    } else if hello.role != expect {
        Some(format!(
            "unexpected role {:?}, expected {expect:?}",
            hello.role
        ))
    } else {
        None
    };
    match refusal {
        Some(why) => {
            let _ = write_frame(stream, &HandshakeReply::Refused(why.clone()).encode());
            Err(CollectiveError::Refused(why))
        }
        None => {
            write_frame(stream, &HandshakeReply::Accepted.encode())?;
            Ok(hello)
        }
    }
}

/// Sends our hello and reads the acceptor's answer.
pub(crate) fn offer_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
) -> Result<(), CollectiveError> {
    write_frame(stream, &hello.encode())?;
    finish_handshake(stream)
}

pub(crate) fn finish_handshake(stream: &mut TcpStream) -> Result<(), CollectiveError> {
    let frame = read_frame(stream, 4096)?.ok_or(WireError::Truncated)?;
    match HandshakeReply::decode(&frame)? {
        HandshakeReply::Accepted => Ok(()),
        HandshakeReply::Refused(why) => Err(CollectiveError::Refused(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn role() -> impl Strategy<Value = Role> {
        prop_oneof![Just(Role::StoreClient), Just(Role::RingPeer)]
    }

    proptest! {
        #[test]
        fn frames_round_trip(payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8)) {
            let mut stream = Vec::new();
            for p in &payloads {
                write_frame(&mut stream, p).unwrap();
            }
            let mut r = &stream[..];
            for p in &payloads {
                let got = read_frame(&mut r, 1024).unwrap();
                prop_assert_eq!(got.as_ref(), Some(p));
            }
            prop_assert!(read_frame(&mut r, 1024).unwrap().is_none());
        }

        #[test]
        fn truncated_frames_are_errors(payload in proptest::collection::vec(any::<u8>(), 1..300), cut in 1usize..300) {
            let mut stream = Vec::new();
            write_frame(&mut stream, &payload).unwrap();
            let cut = cut.min(stream.len() - 1);
            let mut r = &stream[..cut];
            prop_assert!(matches!(read_frame(&mut r, 1024), Err(WireError::Truncated)));
        }

        #[test]
        fn hello_round_trips(role in role(), run_id in ".{0,40}", token in ".{0,40}", rank in any::<u32>()) {
            let hello = Hello { role, run_id, token, rank };
            prop_assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        }

        #[test]
        fn reply_round_trips(refused in any::<bool>(), why in ".{0,60}") {
            let reply = if refused { HandshakeReply::Refused(why) } else { HandshakeReply::Accepted };
            prop_assert_eq!(HandshakeReply::decode(&reply.encode()).unwrap(), reply);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Hello::decode(&bytes);
            let _ = HandshakeReply::decode(&bytes);
            let _ = read_frame(&mut &bytes[..], 64);
        }
    }

    #[test]
    fn huge_length_is_refused_before_allocating() {
        let stream = u32::MAX.to_le_bytes();
        let err = read_frame(&mut &stream[..], MAX_CONTROL_FRAME).unwrap_err();
        assert!(matches!(err, WireError::TooLarge { len, .. } if len == u32::MAX as usize));
    }
}
