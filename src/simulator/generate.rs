//! What a call generates: its output length, stop reason, text, faults and timing.
//!
//! - **Output length** is a function of `seed` and the request body (a hash of it seeds a
//!   `SmallRng`), so the same request gets the same answer, direct or through a proxy:
//!   `[sim:output=N]` if the prompt says so, else uniform in
//!   `[output_tokens_min, output_tokens_max]`; capped at `maxTokens` (then the stop reason is
//!   `max_tokens`).
//! - **Random faults** are drawn from `seed` and the call's arrival number instead, so that a
//!   retry of a failed request is an independent draw. `[sim:fault=...]` forces one: `503`,
//!   `500`, `reset` (the connection closes before any response byte), `cut`, `stall`.
//! - **Text** is cheap words of exactly 4 bytes per token (3 letters and a space), so that the
//!   output, re-read by the input-token rule, counts as the tokens it was charged for.
//! - **Timing**: the first token after `time_to_first_token_ms`, then `tokens_per_second`.

use std::hash::{Hash, Hasher};
use std::time::Duration;

use rand::{Rng, SeedableRng, rngs::SmallRng};

use super::config::SimulatorConfig;
use super::request::{Directives, ForcedFault};

/// A fault the simulator injects into one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// 503 `ServiceUnavailableException`, before any quota is taken.
    Unavailable,
    /// 500 `InternalServerException`, before any quota is taken.
    Internal,
    /// The connection closes before any response byte, before any quota is taken.
    Reset,
    /// The response ends abruptly half-way.
    Cut,
    /// The response pauses for `stall_ms` half-way.
    Stall,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::Unavailable,
        Fault::Internal,
        Fault::Reset,
        Fault::Cut,
        Fault::Stall,
    ];

    /// The directive's name: `503`, `500`, `reset`, `cut`, `stall`.
    pub fn label(self) -> &'static str {
        match self {
            Fault::Unavailable => "503",
            Fault::Internal => "500",
            Fault::Reset => "reset",
            Fault::Cut => "cut",
            Fault::Stall => "stall",
        }
    }
}

/// How a model call will go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub output_tokens: u64,
    /// `max_tokens` when capped by the request's maximum, else `end_turn`.
    pub hit_max: bool,
    pub fault: Option<Fault>,
    /// Seeds the generated words.
    pub text_seed: u64,
}

fn body_hash(seed: u64, body: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    seed.hash(&mut h);
    body.hash(&mut h);
    h.finish()
}

/// Plans a call. `arrival` numbers calls in the order they came.
pub fn plan(
    config: &SimulatorConfig,
    body: &[u8],
    max_tokens: u64,
    streaming: bool,
    arrival: u64,
) -> Plan {
    let directives = Directives::scan(body);
    let text_seed = body_hash(config.seed, body);
    let wanted = directives.output.unwrap_or_else(|| {
        let mut rng = SmallRng::seed_from_u64(text_seed);
        rng.random_range(u64::from(config.output_tokens_min)..=u64::from(config.output_tokens_max))
    });
    let fault = match directives.fault {
        Some(ForcedFault::Unavailable) => Some(Fault::Unavailable),
        Some(ForcedFault::Internal) => Some(Fault::Internal),
        Some(ForcedFault::Reset) => Some(Fault::Reset),
        Some(ForcedFault::Cut) => Some(Fault::Cut),
        Some(ForcedFault::Stall) => Some(Fault::Stall),
        None => random_fault(config, streaming, arrival),
    };
    Plan {
        output_tokens: wanted.min(max_tokens),
        hit_max: wanted >= max_tokens,
        fault,
        text_seed,
    }
}

fn random_fault(config: &SimulatorConfig, streaming: bool, arrival: u64) -> Option<Fault> {
    let rates = [
        config.error_503_rate,
        config.stream_cut_rate,
        config.stall_rate,
        config.error_500_rate,
        config.reset_rate,
    ];
    if rates.iter().all(|r| *r == 0.0) {
        return None;
    }
    let mut rng =
        SmallRng::seed_from_u64(config.seed ^ arrival.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    // Always five draws, in this order, so one rate does not shift the others' outcomes (and the
    // first three draws are those of the simulator before 500s and resets existed).
    let [unavailable, cut, stall, internal, reset] = std::array::from_fn(|_| rng.random::<f64>());
    if unavailable < config.error_503_rate {
        Some(Fault::Unavailable)
    } else if internal < config.error_500_rate {
        Some(Fault::Internal)
    } else if reset < config.reset_rate {
        Some(Fault::Reset)
    } else if streaming && cut < config.stream_cut_rate {
        Some(Fault::Cut)
    } else if streaming && stall < config.stall_rate {
        Some(Fault::Stall)
    } else {
        None
    }
}

const WORDS: [&str; 32] = [
    "the", "sim", "bed", "roc", "tok", "ens", "flo", "wer", "and", "map", "sky", "sea", "old",
    "new", "red", "art", "run", "fox", "owl", "cat", "dog", "sun", "far", "way", "now", "all",
    "one", "two", "ten", "fit", "yes", "net",
];

/// `tokens` tokens of text: 3-letter words separated by spaces, 4 bytes a token (the last
/// token has no trailing space).
pub fn text(seed: u64, tokens: u64) -> String {
    let n = usize::try_from(tokens).unwrap_or(0);
    let mut out = String::with_capacity(n * 4);
    let mut x = seed | 1;
    for i in 0..n {
        // xorshift: cheap and deterministic.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

/// The byte range of tokens `[from, to)` in a [`text`].
pub fn token_span(text: &str, from: u64, to: u64) -> &str {
    let start = usize::try_from(from * 4)
        .unwrap_or(usize::MAX)
        .min(text.len());
    let end = usize::try_from(to * 4)
        .unwrap_or(usize::MAX)
        .min(text.len());
    text.get(start..end).unwrap_or("")
}

/// When token `i` (1-based count of tokens emitted) is ready, from the start of the call.
pub fn ready_at(config: &SimulatorConfig, tokens: u64) -> Duration {
    let ttft = Duration::from_millis(config.time_to_first_token_ms);
    if config.tokens_per_second <= 0.0 || tokens <= 1 {
        return ttft;
    }
    let generation = Duration::try_from_secs_f64((tokens - 1) as f64 / config.tokens_per_second)
        .unwrap_or(MAX_GENERATION);
    ttft + generation.min(MAX_GENERATION)
}

/// No simulated generation takes longer than this (keeps timer arithmetic finite).
const MAX_GENERATION: Duration = Duration::from_secs(24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_four_bytes_a_token() {
        for n in [0u64, 1, 2, 17, 100] {
            let t = text(7, n);
            assert_eq!((t.len() as u64).div_ceil(4), n);
            let joined: String = (0..n).map(|i| token_span(&t, i, i + 1)).collect();
            assert_eq!(joined, t);
        }
        assert_eq!(text(1, 5), text(1, 5));
    }

    #[test]
    fn plans_are_deterministic_and_capped() {
        let c = SimulatorConfig::default();
        let a = plan(&c, b"hello", 10_000, false, 1);
        assert_eq!(a, plan(&c, b"hello", 10_000, false, 99));
        assert!((50..=400).contains(&a.output_tokens));
        let p = plan(&c, b"[sim:output=30]", 20, true, 1);
        assert_eq!((p.output_tokens, p.hit_max), (20, true));
        let p = plan(&c, b"[sim:output=30]", 40, true, 1);
        assert_eq!((p.output_tokens, p.hit_max, p.fault), (30, false, None));
        assert_eq!(
            plan(&c, b"[sim:fault=stall]", 40, true, 1).fault,
            Some(Fault::Stall)
        );
    }

    #[test]
    fn random_faults_follow_the_rates() {
        let c = SimulatorConfig {
            error_503_rate: 0.25,
            stream_cut_rate: 1.0,
            ..SimulatorConfig::default()
        };
        let faults: Vec<_> = (0..400)
            .map(|i| plan(&c, b"x", 100, true, i).fault)
            .collect();
        let unavailable = faults
            .iter()
            .filter(|f| **f == Some(Fault::Unavailable))
            .count();
        assert!((60..140).contains(&unavailable), "{unavailable}");
        assert!(faults.iter().all(Option::is_some));
        assert!(
            plan(&c, b"x", 100, false, 3)
                .fault
                .is_none_or(|f| f == Fault::Unavailable)
        );
    }

    #[test]
    fn timing() {
        let c = SimulatorConfig {
            time_to_first_token_ms: 100,
            tokens_per_second: 10.0,
            ..SimulatorConfig::default()
        };
        assert_eq!(ready_at(&c, 1), Duration::from_millis(100));
        assert_eq!(ready_at(&c, 11), Duration::from_millis(1100));
    }
}
