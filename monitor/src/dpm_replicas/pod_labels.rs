//! Pointing clients at the dpm primary on Kubernetes: the chart's primary Service
//! (`<release>-dpm-primary`) selects the pods labelled `dinomo.io/dpm-primary: "true"`, and
//! only this module sets that label. No pod template carries it, so a pod recreated by its
//! StatefulSet (an old primary coming back) is not selected until the monitor says so.
//!
//! A change first removes the label from every other member's pod, then sets it on the new
//! primary's: the Service selects at most one pod at any time (none for a moment).

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::Client;

use super::{MemberConfig, PrimaryPointer};

/// Labels the primary's pod (see the module docs).
pub struct PodLabels {
    pods: Api<Pod>,
    namespace: String,
    label: String,
}

impl std::fmt::Debug for PodLabels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodLabels")
            .field("namespace", &self.namespace)
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

impl PodLabels {
    /// Pods of `namespace` (empty: the client's default, in a pod its own), labelled `label`.
    pub fn new(client: Client, namespace: &str, label: &str) -> Self {
        let namespace = if namespace.is_empty() {
            client.default_namespace().to_string()
        } else {
            namespace.to_string()
        };
        Self {
            pods: Api::namespaced(client, &namespace),
            namespace,
            label: label.to_string(),
        }
    }

    async fn set(&self, pod: &str, value: Option<&str>) -> anyhow::Result<()> {
        let patch = serde_json::json!({ "metadata": { "labels": { &self.label: value } } });
        match self
            .pods
            .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            // A pod being recreated: it comes back without the label.
            Err(kube::Error::Api(s)) if s.is_not_found() && value.is_none() => Ok(()),
            Err(e) => Err(anyhow::anyhow!(
                "labelling pod {}/{pod} {}={}: {e}",
                self.namespace,
                self.label,
                value.unwrap_or("(removed)")
            )),
        }
    }
}

#[async_trait]
impl PrimaryPointer for PodLabels {
    async fn point_at(&self, members: &[MemberConfig], to: usize) -> anyhow::Result<()> {
        for (i, m) in members.iter().enumerate() {
            if i != to {
                self.set(&m.pod, None).await?;
            }
        }
        self.set(&members[to].pod, Some("true")).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::{json, Value};

    fn members() -> Vec<MemberConfig> {
        ["dpm-0", "dpm-backup-0", "dpm-backup-1"]
            .iter()
            .map(|p| MemberConfig {
                address: format!("{p}.svc:7700"),
                pod: p.to_string(),
            })
            .collect()
    }

    /// Answers each PATCH with `status` per pod (200 unless listed), recording the requests.
    async fn api_server(
        mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
        statuses: Vec<(&'static str, u16)>,
    ) -> Vec<(String, String, Value)> {
        let mut seen = Vec::new();
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().to_string(), req.uri().path().to_string());
            let body: Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
            let status = statuses
                .iter()
                .find(|(p, _)| path.ends_with(p))
                .map_or(200, |(_, s)| *s);
            let reply = if status == 200 {
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})
            } else {
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                       "reason": "NotFound", "message": "not found", "code": status})
            };
            send.send_response(
                Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap(),
            );
            seen.push((method, path, body));
        }
        seen
    }

    #[tokio::test]
    async fn the_label_leaves_the_others_before_it_reaches_the_new_primary() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        // dpm-0 (the old primary) is being recreated: its pod is gone.
        let server = tokio::spawn(api_server(handle, vec![("/dpm-0", 404)]));
        let labels = PodLabels::new(
            Client::new(service, "default"),
            "dinomo",
            "dinomo.io/dpm-primary",
        );
        labels.point_at(&members(), 2).await.unwrap();
        drop(labels);
        let seen = server.await.unwrap();
        let pod = |p: &str| format!("/api/v1/namespaces/dinomo/pods/{p}");
        let label = |v: Value| json!({"metadata": {"labels": {"dinomo.io/dpm-primary": v}}});
        assert_eq!(
            seen,
            vec![
                ("PATCH".into(), pod("dpm-0"), label(Value::Null)),
                ("PATCH".into(), pod("dpm-backup-0"), label(Value::Null)),
                ("PATCH".into(), pod("dpm-backup-1"), label(json!("true"))),
            ]
        );
    }

    #[tokio::test]
    async fn a_missing_new_primary_pod_is_an_error() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(api_server(handle, vec![("/dpm-backup-1", 404)]));
        let labels = PodLabels::new(Client::new(service, "default"), "dinomo", "l");
        let err = labels.point_at(&members(), 2).await.unwrap_err();
        assert!(
            format!("{err:#}").contains("labelling pod dinomo/dpm-backup-1 l=true"),
            "{err:#}"
        );
        drop(labels);
        server.await.unwrap();
    }
}
