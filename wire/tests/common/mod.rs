//! Messages shared by the golden-vector and bad-input tests.

use bytes::Bytes;
use kiln_wire::{
    AccessMode, Call, CallCode, Capabilities, Create, Creds, ErrorCode, FdId, FopCode, FopReply,
    Gfid, Groups, Hello, Label, Lookup, Message, Mode, Name, OpenFlags, Outcome, Payload, Reply,
    Request, Write,
};

pub(crate) fn gfid(last: u8) -> Gfid {
    Gfid::from_bytes([0xaa, 0xbb, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last]).expect("not null")
}

pub(crate) fn creds() -> Creds {
    Creds {
        uid: 1000,
        gid: 100,
        groups: Groups::new(vec![10, 20]).expect("few"),
        pid: 42,
    }
}

#[allow(dead_code, reason = "used by golden.rs only")]
pub(crate) fn hex_of(msg: &Message) -> String {
    hex::encode(msg.encode().expect("encodes").to_bytes())
}

pub(crate) fn golden() -> Vec<(&'static str, Message)> {
    vec![
        (
            "lookup",
            Message::Request(Request {
                id: 1,
                call: Call::Fop {
                    creds: creds(),
                    fop: Lookup {
                        parent: Gfid::ROOT,
                        name: Name::new("a.txt").expect("valid"),
                    }
                    .into(),
                },
            }),
        ),
        (
            "create",
            Message::Request(Request {
                id: 2,
                call: Call::Fop {
                    creds: Creds::root(),
                    fop: Create {
                        parent: Gfid::ROOT,
                        name: Name::new("f").expect("valid"),
                        gfid: gfid(1),
                        access: AccessMode::ReadWrite,
                        flags: OpenFlags::EXCL,
                        mode: Mode::new(0o644).expect("valid"),
                        umask: Mode::new(0o022).expect("valid"),
                    }
                    .into(),
                },
            }),
        ),
        (
            "write",
            Message::Request(Request {
                id: 3,
                call: Call::Fop {
                    creds: Creds::root(),
                    fop: Write {
                        fd: FdId {
                            slot: 5,
                            generation: 9,
                        },
                        offset: 4096,
                        data: Payload::new(Bytes::from_static(b"hello")).expect("small"),
                    }
                    .into(),
                },
            }),
        ),
        (
            "error_reply",
            Message::Reply(Reply {
                id: 1,
                outcome: Outcome::Error {
                    call: CallCode::Fop(FopCode::Lookup),
                    error: ErrorCode::NoEnt,
                },
            }),
        ),
        (
            "hello",
            Message::Request(Request {
                id: 0,
                call: Call::Hello(Hello {
                    version_min: 1,
                    version_max: 1,
                    capabilities: Capabilities::INVALIDATE_EVENTS,
                    client_name: Label::new("client-1").expect("valid"),
                }),
            }),
        ),
        (
            "flush_reply",
            Message::Reply(Reply {
                id: 7,
                outcome: Outcome::Fop(FopReply::Flush(kiln_wire::Done {})),
            }),
        ),
    ]
}
