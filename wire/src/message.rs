//! Whole messages: a checked header plus a body, to and from bytes.
//!
//! Bodies: a request is the call's fields (for a fop: the caller's [`Creds`], then the fop's
//! fields); a reply is a `u16` status (0, or an [`ErrorCode`]) followed, on success, by the
//! reply's fields; an event is its fields.

use bytes::{Bytes, BytesMut};

use crate::batch::{Batch, BatchReply};
use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader};
use crate::errno::ErrorCode;
use crate::flags::Creds;
use crate::fop::{FopCode, FopReply, FopRequest};
use crate::frame::{FLAG_BODY_UNCHECKED, FrameKind, Header, checksum, checksum_append};
use crate::ids::RequestId;
use crate::limits::{FRAME_BODY_LEN_MAX_BYTES, FRAME_HEADER_LEN_BYTES};
use crate::session::{Hello, HelloReply, Invalidate, Ping, Recall};

/// Session codes live above the fop range (fop codes stay below 0x100).
const HELLO_CODE: u16 = 0x0100;
const PING_CODE: u16 = 0x0101;
const BATCH_CODE: u16 = 0x0102;
const INVALIDATE_CODE: u16 = 0x0200;
const RECALL_CODE: u16 = 0x0201;

/// What a request or reply is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum CallCode {
    Hello,
    Ping,
    Batch,
    Fop(FopCode),
}

impl CallCode {
    pub fn to_u16(self) -> u16 {
        match self {
            CallCode::Hello => HELLO_CODE,
            CallCode::Ping => PING_CODE,
            CallCode::Batch => BATCH_CODE,
            CallCode::Fop(code) => code as u16,
        }
    }

    pub fn from_u16(code: u16) -> Option<CallCode> {
        match code {
            HELLO_CODE => Some(CallCode::Hello),
            PING_CODE => Some(CallCode::Ping),
            BATCH_CODE => Some(CallCode::Batch),
            _ => FopCode::from_u16(code).map(CallCode::Fop),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CallCode::Hello => "HELLO",
            CallCode::Ping => "PING",
            CallCode::Batch => "BATCH",
            CallCode::Fop(code) => code.name(),
        }
    }
}

/// One frame's content.
#[allow(
    clippy::large_enum_variant,
    reason = "messages are built once and encoded in place"
)]
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum Message {
    Request(Request),
    Reply(Reply),
    Event(Event),
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Request {
    pub id: RequestId,
    pub call: Call,
}

/// What a client asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum Call {
    Hello(Hello),
    Ping(Ping),
    Fop { creds: Creds, fop: FopRequest },
    Batch(Batch),
}

impl Call {
    pub fn code(&self) -> CallCode {
        match self {
            Call::Hello(_) => CallCode::Hello,
            Call::Ping(_) => CallCode::Ping,
            Call::Fop { fop, .. } => CallCode::Fop(fop.code()),
            Call::Batch(_) => CallCode::Batch,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Reply {
    pub id: RequestId,
    pub outcome: Outcome,
}

/// How a call ended.
#[allow(clippy::large_enum_variant, reason = "see `Message`")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum Outcome {
    Hello(HelloReply),
    Ping(Ping),
    Fop(FopReply),
    Batch(BatchReply),
    Error { call: CallCode, error: ErrorCode },
}

impl Outcome {
    pub fn code(&self) -> CallCode {
        match self {
            Outcome::Hello(_) => CallCode::Hello,
            Outcome::Ping(_) => CallCode::Ping,
            Outcome::Fop(reply) => CallCode::Fop(reply.code()),
            Outcome::Batch(_) => CallCode::Batch,
            Outcome::Error { call, .. } => *call,
        }
    }
}

/// What a brick pushes without being asked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum Event {
    Invalidate(Invalidate),
    Recall(Recall),
}

/// Whether frame bodies carry their CRC-32C. A session's frames go without it once both ends
/// negotiated [`Capabilities::UNCHECKED_BODIES`](crate::Capabilities::UNCHECKED_BODIES):
/// under QUIC every packet is authenticated by its AEAD tag, so the body checksum guards
/// nothing the transport does not, and it was 7% of a bulk transfer's CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyChecksum {
    /// Bodies are sent with one and must arrive with one (HELLO, and sessions that did not
    /// negotiate the capability).
    Required,
    /// Bodies are sent without one and are taken without one; a body that carries one is
    /// still checked.
    Omitted,
}

/// An encoded frame: the header and the body as chunks that share large payloads.
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    pub header: [u8; FRAME_HEADER_LEN_BYTES],
    pub body: Vec<Bytes>,
}

impl EncodedFrame {
    /// Header plus body length, in bytes.
    pub fn len(&self) -> usize {
        FRAME_HEADER_LEN_BYTES + self.body.iter().map(Bytes::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The whole frame in one buffer (copies the body).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.len());
        out.extend_from_slice(&self.header);
        for chunk in &self.body {
            out.extend_from_slice(chunk);
        }
        out.freeze()
    }
}

/// Why a message could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("message body is {len} bytes, more than the frame limit of {max}")]
    TooLong { len: usize, max: usize },
}

const STATUS_OK: u16 = 0;

/// CRC-32C of a body given as chunks.
fn body_crc(chunks: &[Bytes]) -> u32 {
    chunks
        .iter()
        .fold(checksum(&[]), |crc, c| checksum_append(crc, c))
}

impl Message {
    /// Encodes the message into a frame with its body checksum. Fails only when the body
    /// would exceed the frame limit, which the validated field types make possible only for
    /// oversized lists.
    pub fn encode(&self) -> Result<EncodedFrame, EncodeError> {
        self.encode_with(BodyChecksum::Required)
    }

    /// [`Message::encode`], with the body checksum or without it.
    pub fn encode_with(&self, crc: BodyChecksum) -> Result<EncodedFrame, EncodeError> {
        let mut out = Encoder::new();
        let (kind, code, request_id) = match self {
            Message::Request(req) => {
                match &req.call {
                    Call::Hello(hello) => hello.encode(&mut out),
                    Call::Ping(ping) => ping.encode(&mut out),
                    Call::Fop { creds, fop } => {
                        creds.encode(&mut out);
                        fop.encode_body(&mut out);
                    }
                    Call::Batch(batch) => batch.encode(&mut out),
                }
                (FrameKind::Request, req.call.code().to_u16(), req.id)
            }
            Message::Reply(reply) => {
                match &reply.outcome {
                    Outcome::Error { error, .. } => error.encode(&mut out),
                    ok => {
                        out.put_u16(STATUS_OK);
                        match ok {
                            Outcome::Hello(r) => r.encode(&mut out),
                            Outcome::Ping(r) => r.encode(&mut out),
                            Outcome::Fop(r) => r.encode_body(&mut out),
                            Outcome::Batch(r) => r.encode(&mut out),
                            Outcome::Error { .. } => {}
                        }
                    }
                }
                (FrameKind::Reply, reply.outcome.code().to_u16(), reply.id)
            }
            Message::Event(Event::Invalidate(inv)) => {
                inv.encode(&mut out);
                (FrameKind::Event, INVALIDATE_CODE, 0)
            }
            Message::Event(Event::Recall(recall)) => {
                recall.encode(&mut out);
                (FrameKind::Event, RECALL_CODE, 0)
            }
        };
        let len = out.len();
        if len > FRAME_BODY_LEN_MAX_BYTES {
            return Err(EncodeError::TooLong {
                len,
                max: FRAME_BODY_LEN_MAX_BYTES,
            });
        }
        let body = out.into_chunks();
        let (flags, body_checksum) = match crc {
            BodyChecksum::Required => (0, body_crc(&body)),
            BodyChecksum::Omitted => (FLAG_BODY_UNCHECKED, 0),
        };
        let header = Header {
            kind,
            code,
            flags,
            request_id,
            body_len: u32::try_from(len).unwrap_or(u32::MAX),
            body_checksum,
        };
        Ok(EncodedFrame {
            header: header.encode(),
            body,
        })
    }

    /// Decodes a body whose header was already checked by [`Header::decode`]. The body must
    /// be exactly `header.body_len` bytes and match the header's checksum, which it must
    /// carry.
    pub fn decode(header: &Header, body: Bytes) -> Result<Message, DecodeError> {
        Self::decode_with(header, body, BodyChecksum::Required)
    }

    /// [`Message::decode`], taking a body without a checksum where `crc` allows it.
    pub fn decode_with(
        header: &Header,
        body: Bytes,
        crc: BodyChecksum,
    ) -> Result<Message, DecodeError> {
        if body.len() != header.body_len as usize {
            return Err(DecodeError::Truncated {
                needed: header.body_len as usize,
                remaining: body.len(),
            });
        }
        match (header.body_checked(), crc) {
            (true, _) if checksum(&body) != header.body_checksum => {
                return Err(DecodeError::BodyChecksum);
            }
            (false, BodyChecksum::Required) => return Err(DecodeError::UncheckedBody),
            _ => {}
        }
        let mut input = Reader::new(body);
        let unknown = || DecodeError::UnknownCode {
            kind: header.kind.name(),
            code: header.code,
        };
        let message = match header.kind {
            FrameKind::Request => {
                let call = match CallCode::from_u16(header.code).ok_or_else(unknown)? {
                    CallCode::Hello => Call::Hello(Hello::decode(&mut input)?),
                    CallCode::Ping => Call::Ping(Ping::decode(&mut input)?),
                    CallCode::Batch => Call::Batch(Batch::decode(&mut input)?),
                    CallCode::Fop(code) => Call::Fop {
                        creds: Creds::decode(&mut input)?,
                        fop: FopRequest::decode_body(code, &mut input)?,
                    },
                };
                Message::Request(Request {
                    id: header.request_id,
                    call,
                })
            }
            FrameKind::Reply => {
                let call = CallCode::from_u16(header.code).ok_or_else(unknown)?;
                let outcome = match input.u16()? {
                    STATUS_OK => match call {
                        CallCode::Hello => Outcome::Hello(HelloReply::decode(&mut input)?),
                        CallCode::Ping => Outcome::Ping(Ping::decode(&mut input)?),
                        CallCode::Batch => Outcome::Batch(BatchReply::decode(&mut input)?),
                        CallCode::Fop(code) => {
                            Outcome::Fop(FopReply::decode_body(code, &mut input)?)
                        }
                    },
                    status => Outcome::Error {
                        call,
                        error: ErrorCode::from_wire(status)
                            .ok_or(DecodeError::UnknownErrorCode(status))?,
                    },
                };
                Message::Reply(Reply {
                    id: header.request_id,
                    outcome,
                })
            }
            // Events answer no request: a non-zero id would not survive a round trip.
            FrameKind::Event if header.request_id != 0 => {
                return Err(DecodeError::invalid("event", "non-zero request id"));
            }
            FrameKind::Event => match header.code {
                INVALIDATE_CODE => {
                    Message::Event(Event::Invalidate(Invalidate::decode(&mut input)?))
                }
                RECALL_CODE => Message::Event(Event::Recall(Recall::decode(&mut input)?)),
                _ => return Err(unknown()),
            },
        };
        input.finish()?;
        Ok(message)
    }

    /// Decodes one complete frame (header and body, nothing after).
    pub fn decode_frame(mut frame: Bytes) -> Result<Message, DecodeError> {
        let header = Header::decode_prefix(&frame)?;
        let body = frame.split_off(FRAME_HEADER_LEN_BYTES);
        if body.len() > header.body_len as usize {
            return Err(DecodeError::TrailingBytes(
                body.len() - header.body_len as usize,
            ));
        }
        Message::decode(&header, body)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    use super::*;

    fn roundtrip(msg: &Message) -> Result<(), TestCaseError> {
        let frame = msg
            .encode()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let bytes = frame.to_bytes();
        prop_assert_eq!(bytes.len(), frame.len());
        let back = Message::decode_frame(bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&back, msg);
        Ok(())
    }

    /// Runs `cases` round trips from a fixed seed and returns the fop codes seen, so the
    /// caller can check that every fop was exercised.
    fn roundtrip_many<S: Strategy<Value = Message>>(
        strategy: impl FnOnce() -> S + Send + 'static,
        cases: u32,
    ) -> HashSet<FopCode> {
        // The derived strategies nest deeply; unoptimised builds need more than the default
        // test-thread stack to build them.
        std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn(move || roundtrip_many_on_this_thread(strategy(), cases))
            .expect("spawn test thread")
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    fn roundtrip_many_on_this_thread<S: Strategy<Value = Message>>(
        strategy: S,
        cases: u32,
    ) -> HashSet<FopCode> {
        let mut runner = TestRunner::new_with_rng(
            Config {
                cases,
                failure_persistence: None,
                ..Config::default()
            },
            proptest::test_runner::TestRng::deterministic_rng(
                proptest::test_runner::RngAlgorithm::ChaCha,
            ),
        );
        let seen = std::cell::RefCell::new(HashSet::new());
        let result = runner.run(&strategy, |msg| {
            if let Message::Request(Request {
                call: Call::Fop { fop, .. },
                ..
            }) = &msg
            {
                seen.borrow_mut().insert(fop.code());
            }
            if let Message::Reply(Reply {
                outcome: Outcome::Fop(r),
                ..
            }) = &msg
            {
                seen.borrow_mut().insert(r.code());
            }
            roundtrip(&msg)
        });
        if let Err(e) = result {
            panic!("round trip failed: {e}");
        }
        seen.into_inner()
    }

    #[test]
    fn every_fop_request_roundtrips() {
        let strategy = || {
            (any::<u64>(), any::<Creds>(), any::<FopRequest>()).prop_map(|(id, creds, fop)| {
                Message::Request(Request {
                    id,
                    call: Call::Fop { creds, fop },
                })
            })
        };
        let seen = roundtrip_many(strategy, 3000);
        let missing: Vec<_> = FopCode::ALL.iter().filter(|c| !seen.contains(c)).collect();
        assert!(missing.is_empty(), "requests never generated: {missing:?}");
    }

    #[test]
    fn every_fop_reply_roundtrips() {
        let strategy = || {
            (any::<u64>(), any::<FopReply>()).prop_map(|(id, r)| {
                Message::Reply(Reply {
                    id,
                    outcome: Outcome::Fop(r),
                })
            })
        };
        let seen = roundtrip_many(strategy, 3000);
        let missing: Vec<_> = FopCode::ALL.iter().filter(|c| !seen.contains(c)).collect();
        assert!(missing.is_empty(), "replies never generated: {missing:?}");
    }

    #[test]
    fn any_message_roundtrips() {
        roundtrip_many(any::<Message>, 2000);
    }

    /// Splits an encoded frame into its checked header and its body.
    fn split(frame: &EncodedFrame) -> (Header, Bytes) {
        let mut bytes = frame.to_bytes();
        let header = Header::decode_prefix(&bytes).expect("header decodes");
        (header, bytes.split_off(FRAME_HEADER_LEN_BYTES))
    }

    #[test]
    fn bodies_go_without_a_checksum_only_where_it_was_negotiated() {
        let msg = Message::Request(Request {
            id: 9,
            call: Call::Ping(Ping { nonce: 3 }),
        });
        let (header, body) = split(&msg.encode_with(BodyChecksum::Omitted).expect("encodes"));
        assert!(!header.body_checked());
        assert_eq!(header.body_checksum, 0);
        assert_eq!(
            Message::decode_with(&header, body.clone(), BodyChecksum::Omitted),
            Ok(msg.clone())
        );
        assert_eq!(
            Message::decode(&header, body),
            Err(DecodeError::UncheckedBody)
        );
        // A checksummed body is checked on a session that omits checksums too.
        let (header, body) = split(&msg.encode().expect("encodes"));
        assert!(header.body_checked());
        let mut bad = body.to_vec();
        bad[0] ^= 1;
        assert_eq!(
            Message::decode_with(&header, Bytes::from(bad), BodyChecksum::Omitted),
            Err(DecodeError::BodyChecksum)
        );
        assert_eq!(
            Message::decode_with(&header, body, BodyChecksum::Omitted),
            Ok(msg)
        );
    }

    proptest! {
        #![proptest_config(Config { cases: 2000, ..Config::default() })]

        /// Arbitrary bytes after a valid header never panic the decoder.
        #[test]
        fn random_bodies_never_panic(kind in 1u8..=3, code in 0u16..0x300, body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let kind = FrameKind::from_u8(kind).expect("1..=3 are kinds");
            let header = Header {
                kind,
                code,
                flags: 0,
                request_id: 7,
                body_len: u32::try_from(body.len()).expect("small"),
                body_checksum: checksum(&body),
            };
            let _ = Message::decode(&header, Bytes::from(body));
        }

        /// Arbitrary bytes as a whole frame never panic the decoder.
        #[test]
        fn random_frames_never_panic(frame in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Message::decode_frame(Bytes::from(frame));
        }
    }
}
