//! The events of a SigV4-signed event stream (InvokeModelWithBidirectionalStream's input),
//! checked one by one as they arrive.
//!
//! The request head is signed without its body ([`super::sigv4::Payload::EventStream`]); an SDK
//! then wraps each event it sends in an *envelope* frame: headers `:date` (a timestamp) and
//! `:chunk-signature` (32 bytes), payload the event's own encoded frame. After its last event it
//! sends an envelope with an empty payload. Each envelope's signature is
//!
//! ```text
//! HMAC(signing key of the :date's day, Region and service,
//!      "AWS4-HMAC-SHA256-PAYLOAD\n{:date as YYYYMMDDTHHMMSSZ}\n{day}/{region}/{service}/aws4_request\n
//!       {previous signature}\n{SHA-256 of the encoded :date header}\n{SHA-256 of the payload}")
//! ```
//!
//! where the previous signature is the last envelope's or, for the first, the head's (the seed):
//! what `aws_sigv4::event_stream::sign_message` computes, and what the tests check this against.
//!
//! [`ChainVerifier::verify`] checks one envelope: both headers there and well formed, the `:date`
//! within [`MAX_SKEW`] of the clock, the signature (compared in constant time); it returns the
//! payload and moves the chain on. A failure breaks the chain for good: every later envelope is
//! refused, since none can be checked without the one before.

use std::time::SystemTime;

use aws_sigv4::sign::v4::{calculate_signature, generate_signing_key};
use aws_smithy_eventstream::frame::write_headers_to;
use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use bytes::Bytes;

use super::{
    amz_date::format_amz_date,
    sigv4::{MAX_SKEW, constant_time_eq, hex_lower, sha256_hex},
};
use crate::config::Secret;

const CHUNK_SIGNATURE: &str = ":chunk-signature";
const DATE: &str = ":date";

/// Why an envelope does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameSignatureError {
    #[error("an input event is not signed (no :chunk-signature envelope)")]
    Unsigned,
    #[error("an input event's envelope is malformed: {0}")]
    Malformed(&'static str),
    #[error("an input event's :date is more than 5 minutes from the server's time")]
    ClockSkew,
    #[error("an input event's signature does not match the signature computed for it")]
    Mismatch,
    #[error("an earlier input event did not verify, so no later one can")]
    Broken,
}

/// Whether `message` is a signed envelope (rather than a bare event).
pub fn is_envelope(message: &Message) -> bool {
    header(message, CHUNK_SIGNATURE).is_some()
}

fn header<'m>(message: &'m Message, name: &str) -> Option<&'m HeaderValue> {
    message
        .headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .map(Header::value)
}

/// Checks the envelopes of one stream in order, chained from the head's signature.
#[derive(Debug)]
pub struct ChainVerifier {
    secret: Secret,
    region: String,
    service: String,
    /// The last signature that verified (the head's to begin with), hex.
    prior: String,
    broken: bool,
}

impl ChainVerifier {
    /// `seed` is the head's signature (hex); `region` and `service` its credential scope's.
    pub fn new(secret: Secret, region: &str, service: &str, seed: &str) -> ChainVerifier {
        ChainVerifier {
            secret,
            region: region.to_string(),
            service: service.to_string(),
            prior: seed.to_string(),
            broken: false,
        }
    }

    /// Checks the next envelope and returns its payload (empty for the end of the stream).
    pub fn verify(
        &mut self,
        envelope: &Message,
        now: SystemTime,
    ) -> Result<Bytes, FrameSignatureError> {
        if self.broken {
            return Err(FrameSignatureError::Broken);
        }
        match self.signature_of(envelope, now) {
            Ok(signature) => {
                self.prior = signature;
                Ok(envelope.payload().clone())
            }
            Err(e) => {
                self.broken = true;
                Err(e)
            }
        }
    }

    /// The envelope's signature, once it is shown to be the one expected.
    fn signature_of(
        &self,
        envelope: &Message,
        now: SystemTime,
    ) -> Result<String, FrameSignatureError> {
        let malformed = FrameSignatureError::Malformed;
        let given = match header(envelope, CHUNK_SIGNATURE) {
            None => return Err(FrameSignatureError::Unsigned),
            Some(HeaderValue::ByteArray(b)) if b.len() == 32 => hex_lower(b),
            Some(_) => return Err(malformed(":chunk-signature is not 32 bytes")),
        };
        let Some(HeaderValue::Timestamp(date)) = header(envelope, DATE) else {
            return Err(malformed(":date is missing or not a timestamp"));
        };
        let at = SystemTime::try_from(*date).map_err(|_| malformed(":date is out of range"))?;
        let skew = now.duration_since(at).unwrap_or_else(|e| e.duration());
        if skew > MAX_SKEW {
            return Err(FrameSignatureError::ClockSkew);
        }
        let mut date_header = Vec::new();
        write_headers_to(
            &[Header::new(DATE, HeaderValue::Timestamp(*date))],
            &mut date_header,
        )
        .map_err(|_| malformed(":date cannot be encoded"))?;
        let (date_time, day) = format_amz_date(at);
        let string_to_sign = format!(
            "AWS4-HMAC-SHA256-PAYLOAD\n{date_time}\n{day}/{}/{}/aws4_request\n{}\n{}\n{}",
            self.region,
            self.service,
            self.prior,
            sha256_hex(&date_header),
            sha256_hex(envelope.payload()),
        );
        let key = generate_signing_key(&self.secret.0, at, &self.region, &self.service);
        let expected = calculate_signature(key, string_to_sign.as_bytes());
        if constant_time_eq(expected.as_bytes(), given.as_bytes()) {
            Ok(given)
        } else {
            Err(FrameSignatureError::Mismatch)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use aws_credential_types::Credentials;
    use aws_sigv4::event_stream::{sign_empty_message, sign_message};
    use aws_sigv4::sign::v4::SigningParams;

    use super::*;

    const SEED: &str = "6b0c3a4b9a1f0e3c0f0e5e1b2a3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e";

    fn t0() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_767_225_600) // 2026-01-01T00:00:00Z
    }

    /// Envelopes as aws-sigv4 (every SDK's signer) makes them, chained from `SEED`.
    fn signed_chain(secret: &str, events: &[&[u8]], at: SystemTime) -> Vec<Message> {
        let identity = Credentials::new("AKIDTEST", secret, None, None, "test").into();
        let mut prior = SEED.to_string();
        let mut out = Vec::new();
        for (i, payload) in events.iter().enumerate() {
            let params = SigningParams::builder()
                .identity(&identity)
                .region("us-east-1")
                .name("bedrock")
                .time(at + Duration::from_millis(1_500 * i as u64))
                .settings(())
                .build()
                .unwrap();
            let (message, signature) = if payload.is_empty() {
                sign_empty_message(&prior, &params).unwrap().into_parts()
            } else {
                let event = Message::new(Bytes::copy_from_slice(payload));
                sign_message(&event, &prior, &params).unwrap().into_parts()
            };
            prior = signature;
            out.push(message);
        }
        out
    }

    fn verifier(secret: &str) -> ChainVerifier {
        ChainVerifier::new(Secret(secret.into()), "us-east-1", "bedrock", SEED)
    }

    #[test]
    fn a_chain_signed_by_aws_sigv4_verifies_to_its_end() {
        let chain = signed_chain("secret", &[b"one", b"two", b""], t0());
        let mut v = verifier("secret");
        let mut payloads = Vec::new();
        for envelope in &chain {
            assert!(is_envelope(envelope));
            payloads.push(v.verify(envelope, t0()).unwrap());
        }
        assert!(
            payloads[0].len() > 3,
            "the payload is the whole inner frame"
        );
        assert!(payloads[2].is_empty(), "the end of the stream");
    }

    #[test]
    fn a_broken_chain_stays_broken() {
        let chain = signed_chain("secret", &[b"one", b"two"], t0());
        // Out of order: the second envelope chains from the first, not from the seed.
        let mut v = verifier("secret");
        assert_eq!(
            v.verify(&chain[1], t0()),
            Err(FrameSignatureError::Mismatch)
        );
        assert_eq!(v.verify(&chain[0], t0()), Err(FrameSignatureError::Broken));
        // Another secret, or another seed.
        assert_eq!(
            verifier("other").verify(&chain[0], t0()),
            Err(FrameSignatureError::Mismatch)
        );
        let mut reseeded =
            ChainVerifier::new(Secret("secret".into()), "us-east-1", "bedrock", "00");
        assert_eq!(
            reseeded.verify(&chain[0], t0()),
            Err(FrameSignatureError::Mismatch)
        );
        // The payload swapped under a good signature.
        let swapped = Message::new(Bytes::from_static(b"evil"));
        let forged = chain[0]
            .headers()
            .iter()
            .cloned()
            .fold(swapped, Message::add_header);
        assert_eq!(
            verifier("secret").verify(&forged, t0()),
            Err(FrameSignatureError::Mismatch)
        );
    }

    #[test]
    fn unsigned_late_and_malformed_envelopes_are_refused() {
        let bare = Message::new(Bytes::from_static(b"x"));
        assert!(!is_envelope(&bare));
        assert_eq!(
            verifier("secret").verify(&bare, t0()),
            Err(FrameSignatureError::Unsigned)
        );
        let chain = signed_chain("secret", &[b"one"], t0());
        let later = t0() + MAX_SKEW + Duration::from_secs(1);
        assert_eq!(
            verifier("secret").verify(&chain[0], later),
            Err(FrameSignatureError::ClockSkew)
        );
        let short = Message::new(Bytes::new()).add_header(Header::new(
            CHUNK_SIGNATURE,
            HeaderValue::ByteArray(Bytes::from_static(b"short")),
        ));
        assert!(matches!(
            verifier("secret").verify(&short, t0()),
            Err(FrameSignatureError::Malformed(_))
        ));
    }
}
