//! Feeds arbitrary bytes to the frame decoder. It must never panic, and whatever it accepts
//! must encode back to the same bytes and decode to the same message.
//!
//! Random bytes almost never carry valid CRC-32C checksums, so each input is tried twice: as
//! it is (exercising the header checks) and with magic, version, body length and both
//! checksums fixed up (exercising every message decoder behind them).

#![no_main]

use bytes::Bytes;
use kiln_wire::limits::FRAME_HEADER_LEN_BYTES;
use kiln_wire::{MAGIC, Message, PROTOCOL_VERSION, checksum};

fn check(input: &Bytes) {
    if let Ok(msg) = Message::decode_frame(input.clone()) {
        let encoded = msg
            .encode()
            .expect("a decoded message re-encodes")
            .to_bytes();
        assert_eq!(&encoded, input, "decode/encode is not the identity");
        assert_eq!(Message::decode_frame(encoded).as_ref(), Ok(&msg));
    }
}

fn with_valid_checksums(data: &[u8]) -> Option<Bytes> {
    let mut frame = data.to_vec();
    let body_len = u32::try_from(frame.len().checked_sub(FRAME_HEADER_LEN_BYTES)?).ok()?;
    frame[..4].copy_from_slice(&MAGIC);
    frame[4] = PROTOCOL_VERSION;
    frame[12..16].copy_from_slice(&body_len.to_le_bytes());
    let body_crc = checksum(&frame[FRAME_HEADER_LEN_BYTES..]);
    frame[24..28].copy_from_slice(&body_crc.to_le_bytes());
    let header_crc = checksum(&frame[..28]);
    frame[28..32].copy_from_slice(&header_crc.to_le_bytes());
    Some(Bytes::from(frame))
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    check(&Bytes::copy_from_slice(data));
    if let Some(fixed) = with_valid_checksums(data) {
        check(&fixed);
    }
});
