use std::{
    io,
    sync::{Arc, Mutex},
};

use super::*;

/// A log written into memory.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl io::Write for Buffer {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Buffer {
    fn text(&self) -> String {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        String::from_utf8(bytes.clone()).expect("a log is UTF-8")
    }
}

/// What `emit` logs, formatted by the default field formatter and by [`TextFields`].
fn both(ansi: bool, emit: impl Fn()) -> (String, String) {
    let default = Buffer::default();
    let ours = Buffer::default();
    let (to_default, to_ours) = (default.clone(), ours.clone());
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(ansi)
        .without_time()
        .with_writer(move || to_default.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, &emit);
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(ansi)
        .without_time()
        .fmt_fields(TextFields)
        .with_writer(move || to_ours.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, &emit);
    (default.text(), ours.text())
}

#[derive(Debug)]
struct Outer(Inner);

#[derive(Debug)]
struct Inner;

impl fmt::Display for Outer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("upstream \"closed\"")
    }
}

impl fmt::Display for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("reset by peer")
    }
}

impl std::error::Error for Outer {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl std::error::Error for Inner {}

/// Events with every kind of value the proxy logs, and the escapes `Debug` makes.
fn events() {
    let absent: Option<&str> = None;
    tracing::info!(
        target: "tokengate::access",
        request_id = "11c1c598-ffc7-213f-0716-0d44da5d3b4b",
        pool = Some("sonnet4-us"),
        spilled_from = absent,
        model = "us.anthropic.claude-sonnet-4-20250514-v1:0",
        status = 200u16,
        reserved = 166u64,
        charged = 0u64,
        below = -5i64,
        shadow = true,
        latency_ms = 0.328f64,
        whole_ms = 3.0f64,
        "request"
    );
    tracing::warn!(
        quoted = "say \"hi\"",
        backslash = "C:\\temp",
        newline = "two\nlines",
        tab = "a\tb",
        bell = "\u{7}",
        escape = "\u{1b}[31mred",
        unicode = "héllo wörld",
        combining = "e\u{301}",
        empty = "",
        r#type = "raw name",
        "a message with {} and \"quotes\"",
        "args"
    );
    let error = Outer(Inner);
    tracing::error!(
        error = &error as &(dyn std::error::Error + 'static),
        display = %"shown by Display",
        debug = ?vec!["a", "b"],
        "failed"
    );
    tracing::info!(first = 1u64, second = "two");
    tracing::info!("only a message");
    let span = tracing::info_span!("call", route = "team-a", attempt = 2u64, id = "x\"y");
    let _entered = span.enter();
    tracing::info!(inside = "the span", count = 7i64, "in a span");
}

#[test]
fn lines_are_the_default_formatter_s_byte_for_byte() {
    let (default, ours) = both(false, events);
    assert_eq!(ours, default);
    assert_eq!(default.lines().count(), 6, "{default}");
    assert!(
        default.contains(r#"request_id="11c1c598-ffc7-213f-0716-0d44da5d3b4b""#),
        "{default}"
    );
    assert!(default.contains(r#"quoted="say \"hi\"""#), "{default}");
}

#[test]
fn coloured_lines_are_the_default_formatter_s_too() {
    let (default, ours) = both(true, events);
    assert_eq!(ours, default);
    assert!(default.contains('\u{1b}'), "coloured: {default:?}");
}

#[test]
fn debug_leaves_printable_ascii_without_quotes_or_backslashes_as_is() {
    for plain in ["", "abc", "us.anthropic.claude:0", "a b ~ { } ' `"] {
        assert!(debug_leaves_as_is(plain), "{plain}");
        assert_eq!(format!("{plain:?}"), format!("\"{plain}\""));
    }
    for escaped in ["\"", "\\", "\n", "\u{7f}", "é", "\u{1b}"] {
        assert!(!debug_leaves_as_is(escaped), "{escaped:?}");
    }
}
