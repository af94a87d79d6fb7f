//! A Prometheus text exposition, parsed for assertions.

use std::collections::BTreeMap;

/// One sample: its labels and value.
pub type Sample = (BTreeMap<String, String>, f64);

/// A scrape, parsed: `name` -> [(labels, value)].
pub struct Scrape(pub BTreeMap<String, Vec<Sample>>);

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        let mut out: BTreeMap<_, Vec<_>> = BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("name value");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').expect("label");
                    (k.to_string(), v.trim_matches('"').to_string())
                })
                .collect();
            out.entry(name.to_string())
                .or_default()
                .push((labels, value.parse().expect("value")));
        }
        Scrape(out)
    }

    /// The value of the one series of `name` with exactly `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.0
            .get(name)
            .and_then(|s| s.iter().find(|(l, _)| *l == want))
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("no series {name}{want:?}"))
    }

    pub fn expect(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        assert_eq!(self.get(name, labels), value, "{name}{labels:?}");
    }
}
