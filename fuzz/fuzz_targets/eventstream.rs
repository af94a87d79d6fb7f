//! The event-stream frame reader on arbitrary bytes split at arbitrary points, and on real
//! frames (built from fuzzed types and payloads) so the decoder gets past its CRC checks.
//!
//! Properties: never panics; valid frames come back as they were written, whatever the split;
//! the reader holds no more than it was given.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tokengate::bedrock::{
    ErrorCode,
    eventstream::{FrameReader, event_frame, exception_frame},
};

#[derive(Arbitrary, Debug)]
struct Input {
    /// Well-formed frames: (exception?, type, payload).
    frames: Vec<(bool, String, Vec<u8>)>,
    /// Garbage appended after them.
    tail: Vec<u8>,
    /// Chunk lengths to cut the wire into (cycled).
    splits: Vec<u16>,
}

fuzz_target!(|input: Input| {
    let mut wire = Vec::new();
    let mut expected = Vec::new();
    for (exception, kind, payload) in &input.frames {
        let bytes = if *exception {
            exception_frame(
                ErrorCode::ModelStreamError,
                &String::from_utf8_lossy(payload),
            )
        } else {
            event_frame(kind, payload)
        };
        // The encoder gives up (empty) on what the format cannot hold, e.g. a name over 255 bytes.
        if !bytes.is_empty() {
            expected.push((*exception, kind.clone(), payload.clone()));
            wire.extend_from_slice(&bytes);
        }
    }
    wire.extend_from_slice(&input.tail);

    let mut reader = FrameReader::new();
    let mut decoded = Vec::new();
    let mut rest = &wire[..];
    let mut fed = 0usize;
    let mut splits = input.splits.iter().cycle();
    let mut failed = false;
    while !rest.is_empty() && !failed {
        let n = splits
            .next()
            .map_or(rest.len(), |s| usize::from(*s).max(1))
            .min(rest.len());
        reader.push(&rest[..n]);
        fed += n;
        rest = &rest[n..];
        loop {
            match reader.next_frame() {
                Ok(Some(frame)) => decoded.push(frame),
                Ok(None) => break,
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        assert!(reader.pending() <= fed);
    }
    // Every well-formed frame before the garbage decodes, in order, as written.
    for (i, (exception, kind, payload)) in expected.iter().enumerate() {
        let frame = decoded.get(i).expect("every valid frame decodes");
        if *exception {
            assert_eq!(
                (frame.message_type.as_str(), frame.kind.as_str()),
                ("exception", "modelStreamErrorException")
            );
        } else {
            assert_eq!(
                (frame.message_type.as_str(), frame.kind.as_str()),
                ("event", kind.as_str())
            );
            assert_eq!(&frame.payload[..], &payload[..]);
        }
    }
});
