//! Golden byte vectors: the exact bytes of a few frames, frozen. If one of these fails, the
//! wire format changed, which breaks every deployed peer: add a new message instead.

mod common;

use bytes::Bytes;
use common::{golden, hex_of};
use kiln_wire::Message;

const EXPECTED: &[(&str, &str)] = &[
    (
        "lookup",
        "4b494c4e01011b00000000002e0000000100000000000000b022ad6819b98f08e803000064000000020000000a000000140000002a0000000000000000000000000000000000000105612e747874",
    ),
    (
        "create",
        "4b494c4e01011700000000003b0000000200000000000000f8c119fa3aeda17b00000000000000000000000000000000000000000000000000000000000000010166aabb00000000000000000000000000010204000000a4011200",
    ),
    (
        "write",
        "4b494c4e01010d00000000002900000003000000000000004f27b52e169c947700000000000000000000000000000000050000000900000000100000000000000500000068656c6c6f",
    ),
    (
        "error_reply",
        "4b494c4e01021b00000000000200000001000000000000003c4724d6b8c1365c0200",
    ),
    (
        "hello",
        "4b494c4e01010001000000001300000000000000000000005d21b88f8a7400ae0101010000000000000008636c69656e742d31",
    ),
    (
        "flush_reply",
        "4b494c4e01020f0000000000020000000700000000000000d27761f18f1326860000",
    ),
];

#[test]
fn frames_match_golden_bytes() {
    let golden = golden();
    assert_eq!(golden.len(), EXPECTED.len());
    // Printed so a deliberate new vector can be pasted in; existing ones must never change.
    for (name, msg) in &golden {
        println!("(\"{name}\", \"{}\"),", hex_of(msg));
    }
    for ((name, msg), (expected_name, expected_hex)) in golden.iter().zip(EXPECTED) {
        assert_eq!(name, expected_name);
        let hex = hex_of(msg);
        assert_eq!(&hex, expected_hex, "{name} changed on the wire");
        let decoded = Message::decode_frame(Bytes::from(hex::decode(expected_hex).expect("hex")));
        assert_eq!(decoded.as_ref(), Ok(msg), "{name} no longer decodes");
    }
}
