//! The transports to SageMaker: one signing client per sagemaker-runtime (or control plane)
//! base URL and Region, signed for service `sagemaker` with the proxy's credentials.
//!
//! Endpoint pools name where their calls go (`[[endpoints]] runtime_url`, `control_url`): AWS
//! (`https://runtime.sagemaker.{region}.amazonaws.com`, `https://api.sagemaker.{region}.amazonaws.com`),
//! the in-process simulator, or a URL. Each distinct base and Region gets one [`Upstream`] (its
//! own connection pool), made the first time it is asked for and kept for the life of the
//! process, across reloads; the configured ones are made at start.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
    time::Duration,
};

use aws_credential_types::provider::SharedCredentialsProvider;
use http::Uri;
use tokio_util::sync::CancellationToken;

use super::{SAGEMAKER_SIGNING_NAME, Signer, Upstream, UpstreamError};
use crate::config::Endpoint;

/// Which SageMaker service a client talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    /// sagemaker-runtime: the invocations.
    Runtime,
    /// The control plane: DescribeEndpoint, DescribeInferenceComponent.
    Control,
}

impl Service {
    fn host_prefix(self) -> &'static str {
        match self {
            Service::Runtime => "runtime.sagemaker",
            Service::Control => "api.sagemaker",
        }
    }
}

/// The timeouts every SageMaker client shares (`[upstream]`'s).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub response: Duration,
    pub idle: Duration,
}

/// Every SageMaker client of the process, by base URL and Region.
#[derive(Debug)]
pub struct SageMakerUpstreams {
    credentials: SharedCredentialsProvider,
    /// The in-process simulator's base, with `upstream.endpoint = "simulated"`.
    simulated: Option<Uri>,
    /// `upstream.region`: where calls to endpoints in no pool go.
    region: String,
    timeouts: Timeouts,
    deadline: CancellationToken,
    clients: RwLock<HashMap<(String, String), Arc<Upstream>>>,
}

impl SageMakerUpstreams {
    pub fn new(
        credentials: SharedCredentialsProvider,
        simulated: Option<Uri>,
        region: String,
        timeouts: Timeouts,
        deadline: CancellationToken,
    ) -> SageMakerUpstreams {
        SageMakerUpstreams {
            credentials,
            simulated,
            region,
            timeouts,
            deadline,
            clients: RwLock::new(HashMap::new()),
        }
    }

    /// The client for `service` at `endpoint` in `region`.
    pub fn client(
        &self,
        service: Service,
        endpoint: &Endpoint,
        region: &str,
    ) -> Result<Arc<Upstream>, UpstreamError> {
        let base = self.base(service, endpoint, region)?;
        let key = (base.to_string(), region.to_string());
        if let Some(client) = self.read().get(&key) {
            return Ok(client.clone());
        }
        let mut clients = self.clients.write().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = clients.get(&key) {
            return Ok(client.clone());
        }
        let signer =
            Signer::new(self.credentials.clone(), region).for_service(SAGEMAKER_SIGNING_NAME);
        let t = self.timeouts;
        let client = Arc::new(
            Upstream::new(base, signer, t.connect, t.response, t.idle)?
                .with_deadline(self.deadline.clone()),
        );
        clients.insert(key, client.clone());
        Ok(client)
    }

    /// sagemaker-runtime for a call to an endpoint in no pool (`unknown_models = "pass"`): the
    /// simulator when one runs, else AWS in `upstream.region`.
    pub fn default_runtime(&self) -> Result<Arc<Upstream>, UpstreamError> {
        let endpoint = match self.simulated {
            Some(_) => Endpoint::Simulated,
            None => Endpoint::Aws,
        };
        self.client(Service::Runtime, &endpoint, &self.region.clone())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<(String, String), Arc<Upstream>>> {
        self.clients.read().unwrap_or_else(|p| p.into_inner())
    }

    fn base(
        &self,
        service: Service,
        endpoint: &Endpoint,
        region: &str,
    ) -> Result<Uri, UpstreamError> {
        let bad = |url: String, e: String| UpstreamError::Connect(url, e);
        match endpoint {
            Endpoint::Url(uri) => Ok(uri.clone()),
            Endpoint::Simulated => self.simulated.clone().ok_or_else(|| {
                bad(
                    "simulated".into(),
                    "no simulator runs in this process (upstream.endpoint is not \"simulated\")"
                        .into(),
                )
            }),
            Endpoint::Aws => {
                let url = format!("https://{}.{region}.amazonaws.com", service.host_prefix());
                url.parse()
                    .map_err(|e: http::uri::InvalidUri| bad(url, e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use aws_credential_types::Credentials;

    use super::*;

    fn upstreams(simulated: Option<&str>) -> SageMakerUpstreams {
        let credentials =
            SharedCredentialsProvider::new(Credentials::new("AKID", "s", None, None, "t"));
        let timeouts = Timeouts {
            connect: Duration::from_secs(1),
            response: Duration::from_secs(1),
            idle: Duration::from_secs(1),
        };
        SageMakerUpstreams::new(
            credentials,
            simulated.map(|s| s.parse().unwrap()),
            "us-east-1".into(),
            timeouts,
            CancellationToken::new(),
        )
    }

    #[test]
    fn aws_hosts_per_service_and_region_and_one_client_each() {
        let u = upstreams(None);
        let runtime = u
            .base(Service::Runtime, &Endpoint::Aws, "eu-west-1")
            .unwrap();
        assert_eq!(
            runtime.to_string(),
            "https://runtime.sagemaker.eu-west-1.amazonaws.com/"
        );
        let control = u
            .base(Service::Control, &Endpoint::Aws, "eu-west-1")
            .unwrap();
        assert_eq!(
            control.to_string(),
            "https://api.sagemaker.eu-west-1.amazonaws.com/"
        );
        let a = u
            .client(Service::Runtime, &Endpoint::Aws, "eu-west-1")
            .unwrap();
        let b = u
            .client(Service::Runtime, &Endpoint::Aws, "eu-west-1")
            .unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = u
            .client(Service::Runtime, &Endpoint::Aws, "us-east-1")
            .unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
    }

    #[test]
    fn simulated_needs_a_simulator() {
        assert!(
            upstreams(None)
                .client(Service::Runtime, &Endpoint::Simulated, "us-east-1")
                .is_err()
        );
        let u = upstreams(Some("http://127.0.0.1:9"));
        let sim = u
            .base(Service::Control, &Endpoint::Simulated, "us-east-1")
            .unwrap();
        assert_eq!(sim.to_string(), "http://127.0.0.1:9/");
    }
}
