//! Writes one encoded frame per message kind into a directory, as a seed corpus for the
//! fuzzer: `cargo run -p kiln-wire --example seed_corpus -- DIR`.

use std::path::PathBuf;

use bytes::Bytes;
use kiln_wire::{
    Call, CallCode, Capabilities, Creds, DirEntry, ErrorCode, FdId, FileType, FopCode, FopReply,
    Gfid, Hello, Label, Lookup, Message, Name, Outcome, Payload, ReaddirReply, Reply, Request,
    SetAttr, Setattr, TimeSet, Write,
};

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "corpus".into()));
    std::fs::create_dir_all(&dir)?;
    let fop = |id, fop: kiln_wire::FopRequest| {
        Message::Request(Request {
            id,
            call: Call::Fop {
                creds: Creds::root(),
                fop,
            },
        })
    };
    let name = |s: &str| Name::new(s.to_owned()).expect("valid name");
    let messages = [
        fop(
            1,
            Lookup {
                parent: Gfid::ROOT,
                name: name("a"),
            }
            .into(),
        ),
        fop(
            2,
            Write {
                fd: FdId {
                    slot: 1,
                    generation: 1,
                },
                offset: 0,
                data: Payload::new(Bytes::from_static(b"data"))?,
            }
            .into(),
        ),
        fop(
            3,
            Setattr {
                gfid: Gfid::ROOT,
                attr: SetAttr {
                    mode: None,
                    atime: Some(TimeSet::Now),
                    ..SetAttr::default()
                },
            }
            .into(),
        ),
        Message::Request(Request {
            id: 0,
            call: Call::Hello(Hello {
                version_min: 1,
                version_max: 1,
                capabilities: Capabilities::SUPPORTED,
                client_name: Label::new("seed")?,
            }),
        }),
        Message::Reply(Reply {
            id: 4,
            outcome: Outcome::Fop(FopReply::Readdir(ReaddirReply {
                entries: vec![DirEntry {
                    offset: 1,
                    ino: 2,
                    file_type: FileType::Regular,
                    name: name("x"),
                }],
                eof: true,
            })),
        }),
        Message::Reply(Reply {
            id: 5,
            outcome: Outcome::Error {
                call: CallCode::Fop(FopCode::Unlink),
                error: ErrorCode::NoEnt,
            },
        }),
    ];
    for (i, msg) in messages.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i}")), msg.encode()?.to_bytes())?;
    }
    println!("wrote {} seeds to {}", messages.len(), dir.display());
    Ok(())
}
