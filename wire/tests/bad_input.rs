//! Truncated, corrupt, oversized and ill-formed input: every case returns a typed error.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::{creds, golden};
use kiln_wire::limits::{
    FRAME_BODY_LEN_MAX_BYTES, FRAME_HEADER_LEN_BYTES, IO_SIZE_MAX_BYTES, XATTR_VALUE_LEN_MAX_BYTES,
};
use kiln_wire::{
    Creds, DecodeError, Encode, Encoder, FopCode, FrameKind, Gfid, Groups, Header, Message,
    checksum,
};

/// A frame with a valid header and checksums around an arbitrary body.
fn frame(kind: FrameKind, code: u16, body: &[u8]) -> Bytes {
    let request_id = if kind == FrameKind::Event { 0 } else { 9 };
    frame_with_id(kind, code, request_id, body)
}

fn frame_with_id(kind: FrameKind, code: u16, request_id: u64, body: &[u8]) -> Bytes {
    let header = Header {
        kind,
        code,
        flags: 0,
        request_id,
        body_len: u32::try_from(body.len()).expect("small"),
        body_checksum: checksum(body),
    };
    let mut out = BytesMut::new();
    out.put_slice(&header.encode());
    out.put_slice(body);
    out.freeze()
}

/// Encoded caller credentials, the start of every fop request body.
fn creds_bytes() -> Vec<u8> {
    let mut enc = Encoder::new();
    creds().encode(&mut enc);
    enc.into_chunks().concat()
}

fn request(code: FopCode, args: &[u8]) -> Result<Message, DecodeError> {
    let body = [creds_bytes(), args.to_vec()].concat();
    Message::decode_frame(frame(FrameKind::Request, code as u16, &body))
}

fn lookup_args(name: &[u8]) -> Vec<u8> {
    let mut args = Gfid::ROOT.as_bytes().to_vec();
    args.push(u8::try_from(name.len()).expect("short"));
    args.extend_from_slice(name);
    args
}

#[test]
fn every_truncation_is_an_error() {
    for (name, msg) in golden() {
        let bytes = msg.encode().expect("encodes").to_bytes();
        for len in 0..bytes.len() {
            let result = Message::decode_frame(bytes.slice(..len));
            assert!(
                matches!(result, Err(DecodeError::Truncated { .. })),
                "{name} cut to {len} bytes gave {result:?}"
            );
        }
    }
}

#[test]
fn every_bit_flip_is_an_error() {
    for (name, msg) in golden() {
        let bytes = msg.encode().expect("encodes").to_bytes().to_vec();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[i] ^= 1 << bit;
                let result = Message::decode_frame(Bytes::from(bad));
                assert!(
                    result.is_err(),
                    "{name}: flip of byte {i} bit {bit} accepted"
                );
            }
        }
    }
}

#[test]
fn trailing_bytes_are_refused() {
    let msg = &golden()[0].1;
    let mut bytes = msg.encode().expect("encodes").to_bytes().to_vec();
    bytes.push(0);
    assert_eq!(
        Message::decode_frame(Bytes::from(bytes)),
        Err(DecodeError::TrailingBytes(1))
    );

    // Extra bytes inside the body, covered by a valid checksum, are refused too.
    let mut args = lookup_args(b"a");
    args.push(0);
    assert_eq!(
        request(FopCode::Lookup, &args),
        Err(DecodeError::TrailingBytes(1))
    );
}

#[test]
fn oversized_frames_are_refused_from_the_header_alone() {
    let header = Header {
        kind: FrameKind::Request,
        code: FopCode::Write as u16,
        flags: 0,
        request_id: 1,
        body_len: u32::MAX,
        body_checksum: 0,
    };
    assert_eq!(
        Header::decode(&header.encode()),
        Err(DecodeError::TooLong {
            what: "frame body",
            len: u32::MAX as usize,
            max: FRAME_BODY_LEN_MAX_BYTES
        })
    );
}

#[test]
fn bad_names_are_refused() {
    assert!(request(FopCode::Lookup, &lookup_args(b"ok")).is_ok());
    for (bad, why) in [
        (&b""[..], "empty"),
        (b".", "'.' or '..'"),
        (b"..", "'.' or '..'"),
        (b"a/b", "contains '/'"),
        (b"a\0b", "contains NUL"),
    ] {
        assert_eq!(
            request(FopCode::Lookup, &lookup_args(bad)),
            Err(DecodeError::Invalid {
                what: "name",
                reason: why
            }),
            "{bad:?}"
        );
    }
}

#[test]
fn null_gfid_is_refused() {
    let mut args = lookup_args(b"a");
    args[..16].fill(0);
    assert_eq!(
        request(FopCode::Lookup, &args),
        Err(DecodeError::Invalid {
            what: "gfid",
            reason: "null gfid"
        })
    );
}

#[test]
fn the_id_that_names_no_user_is_refused() {
    let minus_one = |creds: Creds| {
        let mut enc = Encoder::new();
        creds.encode(&mut enc);
        let body = [enc.into_chunks().concat(), lookup_args(b"a")].concat();
        Message::decode_frame(frame(FrameKind::Request, FopCode::Lookup as u16, &body))
    };
    let refused = Err(DecodeError::Invalid {
        what: "creds",
        reason: "an id of -1 names no user",
    });
    let base = Creds {
        uid: 1000,
        gid: 1000,
        groups: Groups::default(),
        pid: 1,
    };
    assert!(minus_one(base.clone()).is_ok());
    for bad in [
        Creds {
            uid: u32::MAX,
            ..base.clone()
        },
        Creds {
            gid: u32::MAX,
            ..base.clone()
        },
        Creds {
            groups: Groups::new(vec![10, u32::MAX]).expect("few"),
            ..base.clone()
        },
    ] {
        assert_eq!(minus_one(bad.clone()), refused, "{bad:?}");
    }
}

#[test]
fn oversized_fields_are_refused() {
    // READ of more than 1 MiB.
    let mut args = vec![0u8; 16]; // fd id + offset
    args.extend_from_slice(
        &u32::try_from(IO_SIZE_MAX_BYTES + 1)
            .expect("fits")
            .to_le_bytes(),
    );
    assert!(matches!(
        request(FopCode::Read, &args),
        Err(DecodeError::TooLong { what: "size", .. })
    ));

    // SETXATTR whose value claims more than 64 KiB.
    let mut args = Gfid::ROOT.as_bytes().to_vec();
    args.push(6);
    args.extend_from_slice(b"user.x");
    let len = XATTR_VALUE_LEN_MAX_BYTES + 1;
    args.extend_from_slice(&u32::try_from(len).expect("fits").to_le_bytes());
    args.extend(std::iter::repeat_n(0u8, len));
    args.push(0);
    assert!(matches!(
        request(FopCode::Setxattr, &args),
        Err(DecodeError::TooLong {
            what: "xattr value",
            ..
        })
    ));
}

#[test]
fn lying_list_counts_do_not_allocate() {
    // A READDIR reply claiming 100 000 entries in a 9-byte body: refused before any allocation.
    let mut body = 0u16.to_le_bytes().to_vec();
    body.extend_from_slice(&100_000u32.to_le_bytes());
    body.push(1);
    let result = Message::decode_frame(frame(FrameKind::Reply, FopCode::Readdir as u16, &body));
    assert!(
        matches!(result, Err(DecodeError::Truncated { .. })),
        "{result:?}"
    );

    // Supplementary groups beyond the limit.
    let mut args = 0u32.to_le_bytes().repeat(2);
    args.extend_from_slice(&1000u32.to_le_bytes());
    let result = Message::decode_frame(frame(FrameKind::Request, FopCode::Stat as u16, &args));
    assert!(
        matches!(result, Err(DecodeError::TooLong { what: "groups", .. })),
        "{result:?}"
    );
}

#[test]
fn events_carry_no_request_id() {
    // Found by the fuzzer: an event with a request id decoded but re-encoded without it.
    let mut body = Gfid::ROOT.as_bytes().to_vec();
    body.push(0);
    assert!(Message::decode_frame(frame(FrameKind::Event, 0x0200, &body)).is_ok());
    assert_eq!(
        Message::decode_frame(frame_with_id(FrameKind::Event, 0x0200, 9, &body)),
        Err(DecodeError::Invalid {
            what: "event",
            reason: "non-zero request id"
        })
    );
}

#[test]
fn unknown_codes_are_named() {
    assert_eq!(
        Message::decode_frame(frame(FrameKind::Request, 999, &creds_bytes())),
        Err(DecodeError::UnknownCode {
            kind: "request",
            code: 999
        })
    );
    assert_eq!(
        Message::decode_frame(frame(FrameKind::Event, 1, &[])),
        Err(DecodeError::UnknownCode {
            kind: "event",
            code: 1
        })
    );
    // A reply whose status is not in the error table.
    let body = 4000u16.to_le_bytes();
    assert_eq!(
        Message::decode_frame(frame(FrameKind::Reply, FopCode::Stat as u16, &body)),
        Err(DecodeError::UnknownErrorCode(4000))
    );
}

#[test]
fn bad_enum_and_flag_values_are_refused() {
    // OPEN with access mode 3 (not a mode).
    let mut args = Gfid::ROOT.as_bytes().to_vec();
    args.push(3);
    args.extend_from_slice(&0u32.to_le_bytes());
    assert!(matches!(
        request(FopCode::Open, &args),
        Err(DecodeError::Invalid { .. })
    ));

    // OPEN with an unknown flag bit.
    let mut args = Gfid::ROOT.as_bytes().to_vec();
    args.push(0);
    args.extend_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(matches!(
        request(FopCode::Open, &args),
        Err(DecodeError::Invalid {
            what: "OpenFlags",
            ..
        })
    ));

    // SETATTR asking for both an explicit atime and "now".
    let mut args = Gfid::ROOT.as_bytes().to_vec();
    args.extend_from_slice(&(0x10u32 | 0x80).to_le_bytes());
    args.extend_from_slice(&[0; 12]);
    assert!(matches!(
        request(FopCode::Setattr, &args),
        Err(DecodeError::Invalid {
            what: "setattr mask",
            ..
        })
    ));
}

#[test]
fn header_alone_is_enough_to_size_the_body() {
    let bytes = golden()[2].1.encode().expect("encodes").to_bytes();
    let header = Header::decode_prefix(&bytes).expect("valid header");
    assert_eq!(
        header.body_len as usize,
        bytes.len() - FRAME_HEADER_LEN_BYTES
    );
}
