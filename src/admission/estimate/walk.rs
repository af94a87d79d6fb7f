//! The estimate's walk as serde seeds: one implementation for a raw body, streamed by
//! `serde_json`'s parser without building a tree, and for an already parsed `Value` (a
//! `Deserializer` too). The rules are in the parent module; this file says how each is applied in
//! one forward pass.
//!
//! # One pass
//! A member is seen before the members after it. Three rules look at a sibling:
//! - an object's `type` decides what its `source` is: a `source` met before any `type` is held as
//!   a `Value` until the object ends (Anthropic writes `type` first, so this is rare);
//! - a document source's `type` and `bytes`/`data` decide whether its `text`/`content` count:
//!   those are tallied aside and added at the end if they do;
//! - a document without a `source` is known only at its end.
//!
//! A member name that appears twice in one object is counted each time; a parsed `Value` keeps
//! only the last. JSON leaves duplicate names to the reader (RFC 8259), and counting twice errs
//! high, as the estimate should. (`maxTokens` follows the `Value`: see `MaxTokensFields`.)
//!
//! # Validation and depth
//! Every value is consumed with `deserialize_any`, never `deserialize_ignored_any`, so a raw body
//! is checked exactly as `serde_json::from_slice::<Value>` checks it (UTF-8, escapes, number
//! range): `serde_json`'s skipping is more lenient. The parser's recursion limit (128) bounds the
//! nesting of a raw body, and with it the recursion here; [`MAX_DEPTH`] bounds a `Value` built in
//! code: nothing deeper is read.
//!
//! (Long: one serde visitor per JSON shape the estimate walks; they share the seeds and are
//! read together.)

use std::{borrow::Cow, fmt};

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::{IMAGE_TOKENS, MAX_DEPTH, Tally, UNSIZED_DOCUMENT_TOKENS, VIDEO_TOKENS, decoded_len};

/// Walks any JSON value: strings are text, containers are walked.
pub(crate) fn walk<'de, D: Deserializer<'de>>(tally: &mut Tally, de: D) -> Result<(), D::Error> {
    Seed(Walk::new(tally, 0, Role::Plain)).deserialize(de)
}

/// Consumes any JSON value, counting nothing.
pub(crate) fn skip<'de, D: Deserializer<'de>>(de: D, depth: usize) -> Result<(), D::Error> {
    Seed(Skip { depth }).deserialize(de)
}

/// Consumes the rest of an array at `depth`, counting nothing.
pub(crate) fn skip_seq<'de, A: SeqAccess<'de>>(seq: A, depth: usize) -> Result<(), A::Error> {
    Skip { depth }.seq(seq)
}

/// Sees each member of an object before the tally does: the top level's `maxTokens` fields.
pub(crate) trait Members<'de> {
    /// Reads the value of member `key` if it wants it; see [`Taken`].
    fn member<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<Taken, A::Error>;
    /// Takes back a value it asked for with [`Taken::Value`], once the tally has walked it.
    fn keep(&mut self, key: &str, value: Value);
}

/// What [`Members::member`] did with a member's value.
pub(crate) enum Taken {
    /// Nothing: the tally reads it.
    No,
    /// Read it whole: only for a member the tally skips anyway (`inferenceConfig`).
    Consumed,
    /// Read it as a `Value`, for the tally to walk and then [`Members::keep`].
    Value(Value),
}

/// No member hooks: every object but the top level.
pub(crate) struct NoMembers;

impl<'de> Members<'de> for NoMembers {
    #[inline]
    fn member<A: MapAccess<'de>>(&mut self, _: &str, _: &mut A) -> Result<Taken, A::Error> {
        Ok(Taken::No)
    }

    #[inline]
    fn keep(&mut self, _: &str, _: Value) {}
}

/// Walks an object's members: the rules of the parent module, member by member.
/// `depth` is the members' depth (one below the object's).
pub(crate) fn object<'de, A: MapAccess<'de>, M: Members<'de>>(
    tally: &mut Tally,
    depth: usize,
    mut map: A,
    members: &mut M,
) -> Result<(), A::Error> {
    let mut kind = None;
    let mut early_sources = Vec::new();
    while let Some(key) = map.next_key_seed(KeySeed)? {
        match members.member(&key, &mut map)? {
            Taken::No => {}
            Taken::Consumed => continue,
            Taken::Value(value) => {
                field(tally, &key, kind, depth, &value).map_err(A::Error::custom)?;
                members.keep(&key, value);
                continue;
            }
        }
        match &*key {
            "type" => kind = Some(map.next_value_seed(Seed(KindOf { depth }))?),
            "source" if kind.is_none() => early_sources.push(map.next_value::<Value>()?),
            _ => map.next_value_seed(Field {
                tally: &mut *tally,
                key: &key,
                kind,
                depth,
            })?,
        }
    }
    for source in &early_sources {
        field(tally, "source", kind, depth, source).map_err(A::Error::custom)?;
    }
    Ok(())
}

/// One member already parsed into a `Value`.
fn field(
    tally: &mut Tally,
    key: &str,
    kind: Option<Kind>,
    depth: usize,
    value: &Value,
) -> Result<(), serde_json::Error> {
    Field {
        tally,
        key,
        kind,
        depth,
    }
    .deserialize(value)
}

/// One member of an object; `kind` is the object's own `type` (Anthropic content blocks).
struct Field<'a, 'k> {
    tally: &'a mut Tally,
    key: &'k str,
    kind: Option<Kind>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Field<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        let Field {
            tally,
            key,
            kind,
            depth,
        } = self;
        let role = match key {
            // Not model input, or not text.
            "inferenceConfig"
            | "textGenerationConfig"
            | "cachePoint"
            | "cache_control"
            | "anthropic_version"
            | "anthropic_beta"
            | "requestMetadata"
            | "performanceConfig"
            | "guardrailConfig"
            | "additionalModelResponseFieldPaths"
            | "serviceTier"
            | "stopSequences"
            | "stop_sequences"
            | "stop"
            | "signature"
            | "model"
            | "role"
            | "type"
            | "format"
            | "media_type"
            | "s3Location"
            | "bucketOwner" => return skip(de, depth),
            "messages" | "chat_history" => Role::Messages,
            "tools" | "toolConfig" | "json" => {
                let mut bytes = 0;
                Seed(JsonLen(&mut bytes)).deserialize(de)?;
                tally.add_text_u64(bytes);
                return Ok(());
            }
            "input" => Role::JsonIfObject,
            "image" => Role::FixedIfObject(IMAGE_TOKENS),
            "video" => Role::FixedIfObject(VIDEO_TOKENS),
            "document" => Role::DocumentIfObject,
            "source" if kind == Some(Kind::Image) => return fixed(tally, IMAGE_TOKENS, de, depth),
            "source" if kind == Some(Kind::Document) => {
                return Seed(DocumentSource { tally, depth }).deserialize(de);
            }
            "image_url" | "inputImage" => return fixed(tally, IMAGE_TOKENS, de, depth),
            "images" => return Seed(Images { tally, depth }).deserialize(de),
            _ => Role::Plain,
        };
        Seed(Walk::new(tally, depth, role)).deserialize(de)
    }
}

/// A member counting a fixed number of tokens whatever its value.
fn fixed<'de, D: Deserializer<'de>>(
    tally: &mut Tally,
    tokens: u64,
    de: D,
    depth: usize,
) -> Result<(), D::Error> {
    tally.add_fixed(tokens);
    skip(de, depth)
}

// === impl Seed ===

/// What one value means, by JSON type; [`Seed`] drives it from any deserializer.
pub(crate) trait Handler<'de>: Sized {
    type Out;

    /// The depth of the value: past [`MAX_DEPTH`] it is not read ([`Handler::scalar`] of null).
    fn depth(&self) -> usize;
    /// A number, `true`/`false` or `null`.
    fn scalar(self, value: Value) -> Self::Out;
    fn string(self, s: &str) -> Self::Out;
    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Out, A::Error>;
    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Out, A::Error>;
}

/// A [`Handler`] as a seed and visitor.
pub(crate) struct Seed<H>(pub(crate) H);

impl<'de, H: Handler<'de>> DeserializeSeed<'de> for Seed<H> {
    type Value = H::Out;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<H::Out, D::Error> {
        if self.0.depth() > MAX_DEPTH {
            de.deserialize_ignored_any(self)
        } else {
            de.deserialize_any(self)
        }
    }
}

impl<'de, H: Handler<'de>> Visitor<'de> for Seed<H> {
    type Value = H::Out;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<H::Out, E> {
        Ok(self.0.scalar(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<H::Out, E> {
        Ok(self.0.scalar(Value::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<H::Out, E> {
        Ok(self.0.scalar(Value::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<H::Out, E> {
        Ok(self.0.scalar(Value::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<H::Out, E> {
        Ok(self.0.string(v))
    }

    fn visit_unit<E>(self) -> Result<H::Out, E> {
        Ok(self.0.scalar(Value::Null))
    }

    fn visit_none<E>(self) -> Result<H::Out, E> {
        Ok(self.0.scalar(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<H::Out, A::Error> {
        self.0.seq(seq)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<H::Out, A::Error> {
        self.0.map(map)
    }
}

/// A member name, borrowed from the body unless it had escapes.
pub(crate) struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Cow<'de, str>, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}

// === impl Handlers ===

/// Consumes a value, counting nothing.
pub(crate) struct Skip {
    pub(crate) depth: usize,
}

impl<'de> Handler<'de> for Skip {
    type Out = ();

    fn depth(&self) -> usize {
        self.depth
    }

    fn scalar(self, _: Value) {}

    fn string(self, _: &str) {}

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let depth = self.depth + 1;
        while seq.next_element_seed(Seed(Skip { depth }))?.is_some() {}
        Ok(())
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let depth = self.depth + 1;
        while map.next_key_seed(Seed(Skip { depth }))?.is_some() {
            map.next_value_seed(Seed(Skip { depth }))?;
        }
        Ok(())
    }
}

/// How [`Walk`] treats a value, by the member it is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Strings are text, containers are walked.
    Plain,
    /// `messages`: an array's items are messages (and walked).
    Messages,
    /// An object counts its serialized length (`input` of a tool use).
    JsonIfObject,
    /// An object counts a fixed number of tokens (`image`, `video`).
    FixedIfObject(u64),
    /// An object is a Converse/Nova document.
    DocumentIfObject,
}

/// The walk of one value. Every role walks what is not an object plainly.
struct Walk<'a> {
    tally: &'a mut Tally,
    depth: usize,
    role: Role,
}

impl<'a> Walk<'a> {
    fn new(tally: &'a mut Tally, depth: usize, role: Role) -> Walk<'a> {
        Walk { tally, depth, role }
    }
}

impl<'de> Handler<'de> for Walk<'_> {
    type Out = ();

    fn depth(&self) -> usize {
        self.depth
    }

    fn scalar(self, _: Value) {}

    fn string(self, s: &str) {
        self.tally.string(s);
    }

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let depth = self.depth + 1;
        let mut items = 0u64;
        while seq
            .next_element_seed(Seed(Walk::new(self.tally, depth, Role::Plain)))?
            .is_some()
        {
            items += 1;
        }
        if self.role == Role::Messages {
            self.tally.add_messages(items);
        }
        Ok(())
    }

    fn map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let Walk { tally, depth, role } = self;
        match role {
            Role::Plain | Role::Messages => object(tally, depth + 1, map, &mut NoMembers),
            Role::JsonIfObject => {
                let mut bytes = 0;
                JsonLen(&mut bytes).map(map)?;
                tally.add_text_u64(bytes);
                Ok(())
            }
            Role::FixedIfObject(tokens) => {
                tally.add_fixed(tokens);
                Skip { depth }.map(map)
            }
            Role::DocumentIfObject => document(tally, depth, map),
        }
    }
}

/// Converse / Nova `document`: `name` plus its source.
fn document<'de, A: MapAccess<'de>>(
    tally: &mut Tally,
    depth: usize,
    mut map: A,
) -> Result<(), A::Error> {
    let mut has_source = false;
    while let Some(key) = map.next_key_seed(KeySeed)? {
        match &*key {
            "name" => map.next_value_seed(Seed(Walk::new(tally, depth, Role::Plain)))?,
            "source" => {
                has_source = true;
                map.next_value_seed(Seed(DocumentSource {
                    tally: &mut *tally,
                    depth,
                }))?
            }
            _ => map.next_value_seed(Seed(Skip { depth }))?,
        }
    }
    if !has_source {
        tally.add_fixed(UNSIZED_DOCUMENT_TOKENS);
    }
    Ok(())
}

/// A document source: inline bytes (Converse `bytes`, Anthropic `data`), inline text (`text`,
/// `content`, an Anthropic `text` source), or a reference we cannot size.
struct DocumentSource<'a> {
    tally: &'a mut Tally,
    depth: usize,
}

impl<'de> Handler<'de> for DocumentSource<'_> {
    type Out = ();

    fn depth(&self) -> usize {
        self.depth
    }

    fn scalar(self, _: Value) {
        self.tally.add_fixed(UNSIZED_DOCUMENT_TOKENS);
    }

    fn string(self, _: &str) {
        self.tally.add_fixed(UNSIZED_DOCUMENT_TOKENS);
    }

    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        self.tally.add_fixed(UNSIZED_DOCUMENT_TOKENS);
        Skip { depth: self.depth }.seq(seq)
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let depth = self.depth;
        let (mut text_source, mut bytes, mut data) = (false, None, None);
        // `text`/`content`, counted only if there are no inline bytes.
        let (mut inline_text, mut has_text) = (Tally::default(), false);
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match &*key {
                "type" => text_source = map.next_value_seed(Seed(KindOf { depth }))? == Kind::Text,
                "bytes" => bytes = Some(map.next_value_seed(Seed(Inline { depth }))?),
                "data" => data = Some(map.next_value_seed(Seed(Inline { depth }))?),
                "text" | "content" => {
                    has_text = true;
                    let walk = Walk::new(&mut inline_text, depth, Role::Plain);
                    map.next_value_seed(Seed(walk))?;
                }
                _ => map.next_value_seed(Seed(Skip { depth }))?,
            }
        }
        // `bytes` when present (even if not a string), else `data`.
        match bytes.or(data).flatten() {
            Some(inline) if text_source => self.tally.add_text(inline.len),
            Some(inline) => self.tally.add_text(inline.decoded_len),
            None if has_text => self.tally.add(&inline_text),
            None => self.tally.add_fixed(UNSIZED_DOCUMENT_TOKENS),
        }
        Ok(())
    }
}

/// The sizes of an inline string, or `None` for any other value.
struct Inline {
    depth: usize,
}

#[derive(Debug, Clone, Copy)]
struct InlineSize {
    len: usize,
    decoded_len: usize,
}

impl<'de> Handler<'de> for Inline {
    type Out = Option<InlineSize>;

    fn depth(&self) -> usize {
        self.depth
    }

    fn scalar(self, _: Value) -> Option<InlineSize> {
        None
    }

    fn string(self, s: &str) -> Option<InlineSize> {
        Some(InlineSize {
            len: s.len(),
            decoded_len: decoded_len(s),
        })
    }

    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<InlineSize>, A::Error> {
        Skip { depth: self.depth }.seq(seq).map(|()| None)
    }

    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Option<InlineSize>, A::Error> {
        Skip { depth: self.depth }.map(map).map(|()| None)
    }
}

/// The `type` of an object, as far as the rules care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Image,
    Document,
    Text,
    /// Another string, or not a string.
    Other,
}

struct KindOf {
    depth: usize,
}

impl<'de> Handler<'de> for KindOf {
    type Out = Kind;

    fn depth(&self) -> usize {
        self.depth
    }

    fn scalar(self, _: Value) -> Kind {
        Kind::Other
    }

    fn string(self, s: &str) -> Kind {
        match s {
            "image" => Kind::Image,
            "document" => Kind::Document,
            "text" => Kind::Text,
            _ => Kind::Other,
        }
    }

    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Kind, A::Error> {
        Skip { depth: self.depth }.seq(seq).map(|()| Kind::Other)
    }

    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Kind, A::Error> {
        Skip { depth: self.depth }.map(map).map(|()| Kind::Other)
    }
}

/// Llama 3.2 `images: ["<base64>", ...]`, or a single image value.
struct Images<'a> {
    tally: &'a mut Tally,
    depth: usize,
}

impl<'de> Handler<'de> for Images<'_> {
    type Out = ();

    fn depth(&self) -> usize {
        self.depth
    }

    fn scalar(self, _: Value) {
        self.tally.add_fixed(IMAGE_TOKENS);
    }

    fn string(self, _: &str) {
        self.tally.add_fixed(IMAGE_TOKENS);
    }

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let depth = self.depth + 1;
        let mut images = 0u64;
        while seq.next_element_seed(Seed(Skip { depth }))?.is_some() {
            images += 1;
        }
        self.tally.add_fixed(IMAGE_TOKENS.saturating_mul(images));
        Ok(())
    }

    fn map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        self.tally.add_fixed(IMAGE_TOKENS);
        Skip { depth: self.depth }.map(map)
    }
}

/// Adds the length of the value serialized as compact JSON (what `serde_json::to_writer` of the
/// parsed `Value` writes), without serializing it. No depth limit, as serializing has none.
struct JsonLen<'a>(&'a mut u64);

impl JsonLen<'_> {
    fn add(&mut self, bytes: u64) {
        *self.0 = self.0.saturating_add(bytes);
    }
}

impl<'de> Handler<'de> for JsonLen<'_> {
    type Out = ();

    fn depth(&self) -> usize {
        0
    }

    fn scalar(mut self, value: Value) {
        self.add(super::serialized_len(&value));
    }

    fn string(mut self, s: &str) {
        self.add(super::serialized_len(s));
    }

    /// `[a,b]`
    fn seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        let mut items = 0u64;
        while seq
            .next_element_seed(Seed(JsonLen(&mut *self.0)))?
            .is_some()
        {
            items += 1;
        }
        self.add(2 + items.saturating_sub(1));
        Ok(())
    }

    /// `{"k":v,"l":w}`
    fn map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        let mut members = 0u64;
        while map.next_key_seed(Seed(JsonLen(&mut *self.0)))?.is_some() {
            map.next_value_seed(Seed(JsonLen(&mut *self.0)))?;
            members += 1;
        }
        // Braces, a colon per member, commas between them.
        self.add(2 + members + members.saturating_sub(1));
        Ok(())
    }
}
