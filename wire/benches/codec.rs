//! Encode/decode throughput of representative frames, each beside a plain copy of the same
//! number of bytes (the floor any codec pays to touch its input), so the ratio is readable
//! from one run: `cargo bench -p kiln-wire --bench codec`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln_wire::{
    Call, Creds, DirEntryPlus, FdId, FileType, FopReply, Gfid, Iatt, Lookup, Message, Mode, Name,
    Outcome, Payload, ReaddirpReply, Reply, Request, Timespec, Write,
};

fn gfid(n: u64) -> Gfid {
    let mut b = [0u8; 16];
    b[8..].copy_from_slice(&(n + 2).to_le_bytes());
    Gfid::from_bytes(b).expect("not null")
}

fn iatt(n: u64) -> Iatt {
    let t = Timespec::new(1_700_000_000, 123).expect("valid");
    Iatt {
        gfid: gfid(n),
        ino: n,
        file_type: FileType::Regular,
        mode: Mode::new(0o644).expect("valid"),
        nlink: 2,
        uid: 1000,
        gid: 1000,
        rdev: 0,
        size: 4096,
        blocks: 8,
        blksize: 4096,
        atime: t,
        mtime: t,
        ctime: t,
    }
}

fn fop(id: u64, fop: impl Into<kiln_wire::FopRequest>) -> Message {
    Message::Request(Request {
        id,
        call: Call::Fop {
            creds: Creds::root(),
            fop: fop.into(),
        },
    })
}

fn write(len: usize) -> Message {
    let data = Payload::new(Bytes::from(vec![7u8; len])).expect("within limit");
    fop(
        2,
        Write {
            fd: FdId {
                slot: 1,
                generation: 1,
            },
            offset: 0,
            data,
        },
    )
}

fn cases() -> Vec<(&'static str, Message)> {
    let lookup = fop(
        1,
        Lookup {
            parent: Gfid::ROOT,
            name: Name::new("Makefile").expect("valid"),
        },
    );
    let entries = (0..100)
        .map(|i| DirEntryPlus {
            offset: i + 1,
            name: Name::new(format!("file-{i:05}.c")).expect("valid"),
            iatt: iatt(i),
        })
        .collect();
    let readdirp = Message::Reply(Reply {
        id: 3,
        outcome: Outcome::Fop(FopReply::Readdirp(ReaddirpReply {
            entries,
            eof: false,
        })),
    });
    vec![
        ("lookup", lookup),
        ("write_4k", write(4096)),
        ("write_1m", write(1 << 20)),
        ("readdirp_100", readdirp),
    ]
}

fn codec(c: &mut Criterion) {
    for (name, msg) in cases() {
        let bytes = msg.encode().expect("encodes").to_bytes();
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(BenchmarkId::new("encode", bytes.len()), |b| {
            b.iter(|| black_box(&msg).encode().expect("encodes"));
        });
        group.bench_function(BenchmarkId::new("decode", bytes.len()), |b| {
            b.iter(|| Message::decode_frame(black_box(bytes.clone())).expect("decodes"));
        });
        group.bench_function(BenchmarkId::new("reference_copy", bytes.len()), |b| {
            b.iter(|| black_box(bytes.to_vec()));
        });
        group.finish();
    }
}

criterion_group!(benches, codec);
criterion_main!(benches);
