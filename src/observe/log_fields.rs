//! The text log's fields, written as `tracing-subscriber`'s default formatter writes them, with
//! less work for the common values.
//!
//! The access log writes a line of about 18 fields per request, and the default formatter sends
//! each through `write!` with `Debug`: about 20,000 instructions per line, 10% of a proxied
//! call's (loadtest/RESULTS.md, issue #19, session 9). [`TextFields`] writes a plain string
//! field (printable ASCII without `"` or `\`, what `Debug` leaves as it is), an integer and a
//! bool directly; every other value (the message, floats, errors, strings `Debug` escapes, and
//! everything when the writer colours its output) goes to the default visitor, so the line is
//! the same byte for byte (`log_fields_tests.rs` compares the two).

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::{
    field::{MakeVisitor, VisitFmt, VisitOutput},
    fmt::format::{DefaultVisitor, Writer},
};

/// The fields of a text log line: see the module documentation.
#[derive(Debug, Default, Clone, Copy)]
pub struct TextFields;

impl<'a> MakeVisitor<Writer<'a>> for TextFields {
    type Visitor = TextVisitor<'a>;

    fn make_visitor(&self, writer: Writer<'a>) -> TextVisitor<'a> {
        TextVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
        }
    }
}

/// Writes one line's fields; see [`TextFields`].
#[derive(Debug)]
pub struct TextVisitor<'a> {
    writer: Writer<'a>,
    /// Nothing written yet: the next field goes without a separating space.
    is_empty: bool,
    result: fmt::Result,
}

impl TextVisitor<'_> {
    /// Whether `field` is one this visitor writes itself (a plain name, no colours).
    fn writes(&self, field: &Field) -> bool {
        let name = field.name();
        self.result.is_ok()
            && !self.writer.has_ansi_escapes()
            && name != "message"
            && !name.starts_with("log.")
            && !name.starts_with("r#")
    }

    /// ` name=` (no space before the first field).
    fn name(&mut self, field: &Field) -> fmt::Result {
        if self.is_empty {
            self.is_empty = false;
        } else {
            self.writer.write_char(' ')?;
        }
        self.writer.write_str(field.name())?;
        self.writer.write_char('=')
    }

    fn write_plain(&mut self, field: &Field, value: &str) {
        self.result = self.name(field).and_then(|()| self.writer.write_str(value));
    }

    /// What the default visitor writes for `field`, from where this line stands.
    fn default_visitor(&mut self, field: &Field, visit: impl FnOnce(&mut DefaultVisitor<'_>)) {
        if self.result.is_err() {
            return;
        }
        let mut default = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        visit(&mut default);
        self.result = default.finish();
        // The default visitor skips the log crate's metadata fields, writing nothing.
        if !field.name().starts_with("log.") {
            self.is_empty = false;
        }
    }
}

/// Whether `Debug` writes `value` as it is, between quotes.
fn debug_leaves_as_is(value: &str) -> bool {
    value
        .bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

impl Visit for TextVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.writes(field) && debug_leaves_as_is(value) {
            self.result = self.name(field).and_then(|()| {
                self.writer.write_char('"')?;
                self.writer.write_str(value)?;
                self.writer.write_char('"')
            });
        } else {
            self.default_visitor(field, |v| v.record_str(field, value));
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if self.writes(field) {
            self.write_plain(field, itoa::Buffer::new().format(value));
        } else {
            self.default_visitor(field, |v| v.record_u64(field, value));
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if self.writes(field) {
            self.write_plain(field, itoa::Buffer::new().format(value));
        } else {
            self.default_visitor(field, |v| v.record_i64(field, value));
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if self.writes(field) {
            self.write_plain(field, if value { "true" } else { "false" });
        } else {
            self.default_visitor(field, |v| v.record_bool(field, value));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.default_visitor(field, |v| v.record_error(field, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.default_visitor(field, |v| v.record_debug(field, value));
    }
}

impl VisitOutput<fmt::Result> for TextVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for TextVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

#[cfg(test)]
#[path = "log_fields_tests.rs"]
mod tests;
