//! A bidirectional stream's input on its way upstream, event by event, as the client sends it.
//!
//! [`InputRelay`] is the upstream request's body. Each time it is polled it reads what the client
//! has sent, decodes whole frames (holding at most one partial frame, up to [`FRAME_CAP`]), and
//! for each event:
//!
//! 1. **Unwraps** the client's signed envelope (`:date`, `:chunk-signature`, the event as
//!    payload). In `sigv4` mode the envelope's signature is verified, chained from the head's
//!    ([`ChainVerifier`]); an event that is not in a signed envelope is refused there. In the
//!    other modes envelopes are unwrapped unchecked and bare events are accepted.
//! 2. **Holds the route's ceiling** on the first event, which must then be `sessionStart`: a
//!    `maxTokens` above the route's `max_tokens_ceiling`, or none, is rewritten to the ceiling
//!    (`clamp`), or refused (`reject`) when above it.
//! 3. **Re-signs** the event with the proxy's credentials, chained from the proxy's own head
//!    signature ([`EventSigner`]), and hands the frame to upstream.
//!
//! The client's empty envelope (or the end of its body) becomes the proxy's signed empty
//! envelope, which ends the stream upstream. Nothing is buffered beyond the frames of one read:
//! the relay is polled only as fast as upstream takes the frames (HTTP/2 flow control), and it
//! reads the client no faster.
//!
//! # Failure semantics
//! A refused event (bad signature, bad framing, a frame over [`FRAME_CAP`], the ceiling) ends the
//! input: the reason goes to the [`Link`], whose response ends with an exception frame saying
//! it, and the body fails, which resets the upstream stream so upstream stops the session. The
//! same reset happens when the client's body fails (the client went away) and when the response
//! ends first (the link's `response_done`).

use std::{
    collections::VecDeque,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::SystemTime,
};

use aws_smithy_types::event_stream::Message;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    admission::Problem,
    auth::{
        Authenticator,
        event_stream::{ChainVerifier, FrameSignatureError, is_envelope},
    },
    bedrock::{
        BedrockError, ErrorCode,
        eventstream::{FrameError, FrameReader, encode_message, whole_message},
        session_start::{SessionStart, SessionStartError},
        usage::FRAME_CAP,
    },
    config::MaxTokensPolicy,
    upstream::{EventSigner, UpstreamError},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the two directions of one session tell each other.
#[derive(Debug, Default)]
pub struct Link {
    /// Why the input was refused: the exception the client's stream ends with.
    refused: Mutex<Option<BedrockError>>,
    /// Cancelled once `refused` is set.
    pub input_failed: CancellationToken,
    /// Cancelled when the response ends, finished or dropped: the input stops.
    pub response_done: CancellationToken,
}

impl Link {
    fn refuse(&self, error: BedrockError) {
        *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.input_failed.cancel();
    }

    /// Why the input was refused, once.
    pub fn refusal(&self) -> Option<BedrockError> {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// The route's `max_tokens_ceiling` for the session's `sessionStart`.
#[derive(Debug, Clone)]
pub struct Ceiling {
    pub max_tokens: u64,
    pub policy: MaxTokensPolicy,
    pub route: Arc<str>,
}

/// Why an input event was refused.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error(transparent)]
    Signature(#[from] FrameSignatureError),
    #[error("an input frame is not a valid event-stream frame ({0})")]
    Framing(#[from] FrameError),
    #[error("an input event is larger than {FRAME_CAP} bytes")]
    TooLarge,
    #[error("the input ended inside an event frame")]
    Truncated,
    #[error("{0}; send a sessionStart first, as Nova Sonic requires")]
    SessionStart(#[from] SessionStartError),
    #[error(transparent)]
    Ceiling(Problem),
    #[error(transparent)]
    Signing(#[from] UpstreamError),
}

/// The pieces of an [`InputRelay`] known before upstream is called.
#[derive(Debug)]
pub struct Input {
    /// The client's request body.
    pub client: axum::body::Body,
    /// `sigv4` mode: the verifier of the client's envelopes.
    pub verifier: Option<ChainVerifier>,
    pub ceiling: Option<Ceiling>,
    pub link: Arc<Link>,
    /// Counts events that fail verification.
    pub auth: Arc<Authenticator>,
}

/// The upstream request body of a bidirectional stream (see the module doc).
#[derive(Debug)]
pub struct InputRelay {
    input: Input,
    signer: EventSigner,
    frames: FrameReader,
    /// Re-signed frames ready for upstream.
    ready: VecDeque<Bytes>,
    /// The first event is still to come.
    first: bool,
    /// The end envelope was queued (or the input failed): nothing more is read.
    ended: bool,
    response_done: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl InputRelay {
    pub fn new(input: Input, signer: EventSigner) -> InputRelay {
        let response_done = Box::pin(input.link.response_done.clone().cancelled_owned());
        InputRelay {
            input,
            signer,
            frames: FrameReader::new(),
            ready: VecDeque::new(),
            first: true,
            ended: false,
            response_done,
        }
    }

    /// Takes one read of the client's body.
    fn take(&mut self, data: &[u8]) -> Result<(), Refusal> {
        self.frames.push(data);
        while !self.ended {
            let Some(message) = self.frames.next_message()? else {
                break;
            };
            self.event(&message)?;
        }
        if self.frames.pending() > FRAME_CAP {
            return Err(Refusal::TooLarge);
        }
        Ok(())
    }

    /// One frame from the client: unwrapped (and verified), checked, re-signed.
    fn event(&mut self, message: &Message) -> Result<(), Refusal> {
        let inner = if is_envelope(message) {
            let payload = match self.input.verifier.as_mut() {
                Some(verifier) => verifier.verify(message, SystemTime::now())?,
                None => message.payload().clone(),
            };
            if payload.is_empty() {
                return self.end();
            }
            whole_message(&payload)?
        } else if self.input.verifier.is_some() {
            return Err(FrameSignatureError::Unsigned.into());
        } else {
            message.clone()
        };
        let inner = match std::mem::replace(&mut self.first, false) {
            true => self.session_start(inner)?,
            false => inner,
        };
        let signed = self.signer.sign(&inner)?;
        self.ready.push_back(encode_message(&signed)?);
        Ok(())
    }

    /// The client's stream ended: end upstream's with the proxy's own signed empty envelope.
    fn end(&mut self) -> Result<(), Refusal> {
        self.ended = true;
        if self.frames.pending() > 0 {
            return Err(Refusal::Truncated);
        }
        let end = self.signer.sign_end()?;
        self.ready.push_back(encode_message(&end)?);
        Ok(())
    }

    /// The route's ceiling on the first event (see the module doc); without one, nothing.
    fn session_start(&self, event: Message) -> Result<Message, Refusal> {
        let Some(ceiling) = &self.input.ceiling else {
            return Ok(event);
        };
        let start = SessionStart::read(event.payload())?;
        let limit = ceiling.max_tokens;
        match start.max_tokens()? {
            Some(n) if n <= limit => Ok(event),
            Some(n) if ceiling.policy == MaxTokensPolicy::Reject => {
                Err(Refusal::Ceiling(Problem::AboveCeiling {
                    max_tokens: n,
                    ceiling: limit,
                    route: ceiling.route.clone(),
                }))
            }
            _ => {
                let payload = start.with_max_tokens(limit);
                Ok(event
                    .headers()
                    .iter()
                    .cloned()
                    .fold(Message::new(payload), Message::add_header))
            }
        }
    }

    /// Ends the input on `refusal`: the client is told through the link, upstream by a reset.
    fn refuse(&mut self, refusal: Refusal) -> BoxError {
        self.ended = true;
        self.ready.clear();
        let message = refusal.to_string();
        let error = match &refusal {
            Refusal::Signature(e) => self.input.auth.event_refused(e),
            Refusal::Signing(_) => BedrockError::new(ErrorCode::InternalServer, message.clone()),
            _ => BedrockError::validation(message.clone()),
        };
        self.input.link.refuse(error);
        message.into()
    }
}

impl Body for InputRelay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(frame) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(frame))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if this.response_done.as_mut().poll(cx).is_ready() {
                this.ended = true;
                return Poll::Ready(Some(Err("the session's response ended".into())));
            }
            match Pin::new(&mut this.input.client).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                // The client closed its side without an end envelope.
                Poll::Ready(None) => {
                    if let Err(refusal) = this.end() {
                        return Poll::Ready(Some(Err(this.refuse(refusal))));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.ended = true;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Err(refusal) = this.take(&data) {
                        return Poll::Ready(Some(Err(this.refuse(refusal))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.ready.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
