//! A scenario's `[[routes]]`: each team a route of its own in the proxy, with a key pair that
//! loadgen gives it; the proxy then checks SigV4 and each team's SDK client signs with its keys.
//! A route without a name, one that brings its own keys, or a team without a route is an error
//! naming it.

use anyhow::bail;

use crate::scenario::Scenario;

/// A route's key pair, as the proxy's config and the team's SDK client hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteKey {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl Scenario {
    /// Every route has a `name` and no credentials of its own (they are added here); with
    /// routes, every group's team is one of them.
    pub(crate) fn check_routes(&self) -> anyhow::Result<()> {
        for (i, route) in self.routes.iter().enumerate() {
            if route.get("name").and_then(|n| n.as_str()).is_none() {
                bail!("{}: routes[{i}] needs a name (a group's team)", self.name);
            }
            let own = [
                "access_key_id",
                "secret_access_key",
                "secret_access_key_env",
            ];
            if let Some(key) = own.iter().find(|k| route.contains_key(**k)) {
                bail!(
                    "{}: routes[{i}].{key} is set by loadgen; remove it",
                    self.name
                );
            }
        }
        if self.routes.is_empty() {
            return Ok(());
        }
        for g in &self.groups {
            if self.route_key(&g.team).is_none() {
                bail!(
                    "{}: group {} has no route of that name in [[routes]]",
                    self.name,
                    g.team
                );
            }
        }
        Ok(())
    }

    /// The key pair the proxy gives `team`'s route (`None` without routes, or for a team
    /// without one).
    pub fn route_key(&self, team: &str) -> Option<RouteKey> {
        let i = self
            .routes
            .iter()
            .position(|r| r.get("name").and_then(|n| n.as_str()) == Some(team))?;
        Some(RouteKey {
            access_key_id: format!("AKIALOADGENROUTE{i:04}"),
            secret_access_key: format!("loadgen-secret-{team}"),
        })
    }

    /// `[auth]` and `[[routes]]` for the proxy's config: empty without routes.
    pub(crate) fn routes_config(&self) -> String {
        if self.routes.is_empty() {
            return String::new();
        }
        let routes = self.routes.iter().map(|route| {
            let mut route = route.clone();
            let name = route
                .get("name")
                .and_then(|n| n.as_str())
                .unwrap_or_default();
            if let Some(key) = self.route_key(name) {
                route.insert("access_key_id".into(), key.access_key_id.into());
                route.insert("secret_access_key".into(), key.secret_access_key.into());
            }
            toml::Value::Table(route)
        });
        let mut doc = toml::Table::new();
        doc.insert("routes".into(), toml::Value::Array(routes.collect()));
        let routes = toml::to_string(&doc).unwrap_or_default();
        format!("\n[auth]\nmode = \"sigv4\"\n\n{routes}")
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A group whose team names no route, and a route that brings its own keys, are errors
    /// that name what to change.
    #[test]
    fn routes_must_match_the_teams_and_leave_keys_to_loadgen() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/10-two-teams-routes.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let renamed = text.replace("name = \"batch\"", "name = \"bulk\"");
        let s: Scenario = toml::from_str(&renamed).unwrap();
        let e = s.check_routes().unwrap_err().to_string();
        assert!(e.contains("group batch has no route"), "{e}");
        let keyed = text.replace("priority = 0", "priority = 0\naccess_key_id = \"AKIAX\"");
        let s: Scenario = toml::from_str(&keyed).unwrap();
        let e = s.check_routes().unwrap_err().to_string();
        assert!(
            e.contains("routes[1].access_key_id is set by loadgen"),
            "{e}"
        );
    }
}
