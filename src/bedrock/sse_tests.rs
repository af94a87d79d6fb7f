//! Tests of the SSE reader and the usage-chunk filter.

use proptest::prelude::*;

use super::*;

fn events(stream: &[u8]) -> Vec<Event> {
    let mut reader = SseReader::new();
    reader.push(stream);
    let mut out = Vec::new();
    while let Some(event) = reader.next_event().unwrap() {
        out.push(event);
    }
    out
}

#[test]
fn events_end_at_a_blank_line_whatever_the_line_ends() {
    let stream = b"event: message_start\ndata: {\"a\":1}\n\n: a comment\r\ndata: x\r\ndata: y\r\n\r\ndata:z\r\rdata: partial";
    let got = events(stream);
    assert_eq!(got.len(), 3);
    assert_eq!(got[0].name.as_deref(), Some("message_start"));
    assert_eq!(got[0].data, "{\"a\":1}");
    assert_eq!((got[1].data.as_str(), got[1].data_lines), ("x\ny", 2));
    assert_eq!(got[2].data, "z");
    let raw: Vec<u8> = got.iter().flat_map(|e| e.raw.to_vec()).collect();
    assert_eq!(&stream[..raw.len()], &raw[..], "raw bytes are the stream's");
}

#[test]
fn a_carriage_return_at_the_end_waits_for_its_line_feed() {
    let mut reader = SseReader::new();
    reader.push(b"data: a\r\n\r");
    assert_eq!(reader.next_event(), Ok(None));
    reader.push(b"\ndata: b\n\n");
    assert_eq!(reader.next_event().unwrap().unwrap().data, "a");
    assert_eq!(reader.next_event().unwrap().unwrap().data, "b");
    assert_eq!(reader.pending(), 0);
}

#[test]
fn an_endless_event_is_refused_not_buffered() {
    let mut reader = SseReader::new();
    reader.push(b"data: ");
    reader.push(&vec![b'x'; EVENT_CAP + 1]);
    assert_eq!(reader.next_event(), Err(SseError::TooLong));
}

/// A Chat Completions stream as upstream sends it with `include_usage`, and as without.
const WITH_USAGE: &str = concat!(
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi \\\"there\\\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12}}\n\n",
    "data: [DONE]\n\n",
);
const WITHOUT_USAGE: &str = concat!(
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi \\\"there\\\"\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n",
);

fn filtered(chunks: &[&[u8]]) -> Vec<u8> {
    let mut filter = UsageChunkFilter::new();
    let mut out = Vec::new();
    for chunk in chunks {
        out.extend_from_slice(&filter.push(chunk));
    }
    out.extend_from_slice(&filter.finish());
    out
}

#[test]
fn the_client_gets_the_stream_it_asked_for() {
    let got = filtered(&[WITH_USAGE.as_bytes()]);
    assert_eq!(String::from_utf8(got).unwrap(), WITHOUT_USAGE);
}

#[test]
fn chunks_that_carry_no_usage_pass_byte_for_byte() {
    let stream = "data: {\"choices\": [], \"x\": 1}\n\n: keep-alive\n\nevent: e\ndata: {\"usage\":null}\n\ndata: not json\n\n";
    assert_eq!(filtered(&[stream.as_bytes()]), stream.as_bytes());
}

proptest! {
    /// Any split of the stream into network chunks gives the same client stream.
    #[test]
    fn any_chunking_gives_the_same_stream(cuts in proptest::collection::vec(0usize..WITH_USAGE.len(), 0..12)) {
        let bytes = WITH_USAGE.as_bytes();
        let mut cuts = cuts;
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = Vec::new();
        let mut at = 0;
        for cut in cuts {
            chunks.push(&bytes[at..cut]);
            at = cut;
        }
        chunks.push(&bytes[at..]);
        prop_assert_eq!(filtered(&chunks), WITHOUT_USAGE.as_bytes());
    }
}
