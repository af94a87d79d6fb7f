//! What each client sends and when: Poisson arrival times, the operation and the request shape,
//! all drawn from the scenario's seed so that the direct and the proxy side send the same calls.

use rand::{Rng, SeedableRng, rngs::SmallRng};

use crate::scenario::{Arrival, Group, OpMix, Shape};

/// The operation of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Converse,
    ConverseStream,
    Invoke,
    /// sagemaker-runtime (the endpoint scenario).
    InvokeEndpoint,
    InvokeEndpointWithResponseStream,
}

/// One call, before it is sent.
#[derive(Debug, Clone)]
pub struct Call {
    /// Seconds from the start of the run (open loop only).
    pub at: f64,
    pub op: Op,
    pub prompt: String,
    pub max_tokens: Option<u32>,
    /// The answer's length the prompt asks the simulator for (`[sim:output=N]`).
    pub output_tokens: u32,
    /// A stream the caller drops after its first content event (a client fault).
    pub hang_up: bool,
}

/// Draws calls for one group (or one closed-loop caller) from a seed.
#[derive(Debug)]
pub struct CallSource {
    rng: SmallRng,
    mix: OpMix,
    shapes: Vec<Shape>,
    hang_up_rate: f64,
}

impl CallSource {
    pub fn new(group: &Group, seed: u64) -> CallSource {
        CallSource {
            rng: SmallRng::seed_from_u64(seed),
            mix: group.mix,
            shapes: group.shapes.clone(),
            hang_up_rate: group.hang_up_rate,
        }
    }

    /// The next call's content (its `at` is 0).
    pub fn next_call(&mut self) -> Call {
        let op = self.pick_op();
        let shape = self.pick_shape();
        let words = self
            .rng
            .random_range(shape.prompt_words[0]..=shape.prompt_words[1]);
        let output = self
            .rng
            .random_range(shape.output_tokens[0]..=shape.output_tokens[1]);
        let max_tokens = shape.max_tokens;
        let prompt = prompt(output, words, self.rng.random());
        // Drawn only when asked for, so scenarios without client faults keep their sequences.
        let hang_up = op == Op::ConverseStream
            && self.hang_up_rate > 0.0
            && self.rng.random::<f64>() < self.hang_up_rate;
        Call {
            at: 0.0,
            op,
            prompt,
            max_tokens,
            output_tokens: output,
            hang_up,
        }
    }

    fn pick_op(&mut self) -> Op {
        let m = self.mix;
        let x = self.rng.random::<f64>() * (m.converse + m.converse_stream + m.invoke);
        if x < m.converse {
            Op::Converse
        } else if x < m.converse + m.converse_stream {
            Op::ConverseStream
        } else {
            Op::Invoke
        }
    }

    fn pick_shape(&mut self) -> Shape {
        let total: f64 = self.shapes.iter().map(|s| s.weight.max(0.0)).sum();
        let mut x = self.rng.random::<f64>() * total;
        for s in &self.shapes {
            x -= s.weight.max(0.0);
            if x < 0.0 {
                return s.clone();
            }
        }
        self.shapes[self.shapes.len() - 1].clone()
    }
}

/// A prompt of `words` words that tells the simulator how long to answer; `tag` keeps otherwise
/// equal prompts apart (the simulator's output is a function of the body).
pub fn prompt(output: u32, words: u32, tag: u32) -> String {
    let mut p = format!("[sim:output={output}] request {tag:08x}:");
    for i in 0..words {
        p.push_str([" summarise", " the", " incident", " report", " quickly"][i as usize % 5]);
    }
    p
}

/// The open-loop schedule of a group: Poisson arrivals over `duration` seconds.
pub fn schedule(group: &Group, seed: u64, duration: f64) -> Vec<Call> {
    let Arrival::Poisson {
        start_per_min,
        end_per_min,
        ramp_secs,
    } = group.arrival
    else {
        return Vec::new();
    };
    let ramp = ramp_secs.unwrap_or(duration).max(1e-9);
    let rate = |t: f64| {
        let f = (t / ramp).min(1.0);
        (start_per_min + (end_per_min - start_per_min) * f) / 60.0
    };
    let mut times = SmallRng::seed_from_u64(seed ^ 0x5eed_a11e);
    let mut source = CallSource::new(group, seed);
    let mut calls = Vec::new();
    let mut t = 0.0;
    loop {
        // Thinning against the peak rate keeps a ramp exact.
        let peak = start_per_min.max(end_per_min) / 60.0;
        if peak <= 0.0 {
            return calls;
        }
        t += -(1.0 - times.random::<f64>()).ln() / peak;
        if t >= duration {
            return calls;
        }
        if times.random::<f64>() * peak <= rate(t) {
            let mut call = source.next_call();
            call.at = t;
            calls.push(call);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Group;

    fn group(start: f64, end: f64) -> Group {
        toml::from_str(&format!(
            "team = \"t\"\narrival = {{ kind = \"poisson\", start_per_min = {start}, end_per_min = {end} }}\n\
             mix = {{ converse = 1.0 }}\nshapes = [{{ weight = 1.0, prompt_words = [1, 2], output_tokens = [5, 5], max_tokens = 10 }}]\n"
        ))
        .unwrap()
    }

    #[test]
    fn poisson_count_is_near_the_rate_and_deterministic() {
        let g = group(600.0, 600.0);
        let a = schedule(&g, 1, 100.0);
        assert!((900..1100).contains(&a.len()), "{}", a.len());
        let b = schedule(&g, 1, 100.0);
        assert_eq!(a.len(), b.len());
        assert_eq!(a[10].prompt, b[10].prompt);
    }

    #[test]
    fn a_ramp_puts_more_calls_late() {
        let a = schedule(&group(0.0, 1200.0), 2, 60.0);
        let early = a.iter().filter(|c| c.at < 30.0).count();
        assert!(a.len() - early > 2 * early, "{early} of {}", a.len());
    }

    #[test]
    fn prompt_carries_the_output_directive() {
        assert!(prompt(250, 3, 1).starts_with("[sim:output=250]"));
    }
}
