//! `job launch|status|wait|logs|top|delete` against a mock API server: kube-rs's tower-test
//! pattern, with the answers a real API server gives in each scenario.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deploy::config::Project;
use deploy::kube_api::{ApiError, Kube, Phase};
use deploy::{launchers, manifests};
use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};

/// One canned answer: method, exact path, then the bodies to give in turn (the last repeats).
struct Route {
    method: Method,
    path: String,
    answers: Vec<(StatusCode, String)>,
    served: usize,
    /// What the server says depends on what happened elsewhere (a job completes once its pod
    /// has): answers given instead until another route has served enough requests.
    until: Option<Until>,
}

/// Answers `before` (the last repeats) until the route at `path` has served `count` requests.
struct Until {
    path: String,
    count: usize,
    before: Vec<(StatusCode, String)>,
}

/// A mock API server: answers from its routes, 404 (as the API server does) otherwise, and
/// records every request as `METHOD path?query`.
#[derive(Clone, Default)]
struct MockApi {
    routes: Arc<Mutex<Vec<Route>>>,
    requests: Arc<Mutex<Vec<String>>>,
    bodies: Arc<Mutex<Vec<Value>>>,
}

fn not_found(what: &str) -> (StatusCode, String) {
    status(404, "NotFound", &format!("{what} not found"))
}

fn status(code: u16, reason: &str, message: &str) -> (StatusCode, String) {
    (
        StatusCode::from_u16(code).unwrap(),
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        })
        .to_string(),
    )
}

fn ok(body: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::OK, body.to_string())
}

/// A node whose Ready condition has `status` ("True", "False", "Unknown").
fn node(name: &str, ready: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node", "metadata": { "name": name },
        "status": { "conditions": [{ "type": "Ready", "status": ready, "message": message }] },
    })
}

/// `/version` of a server of version `major.minor`.
fn version_info(major: &str, minor: &str) -> (StatusCode, String) {
    ok(json!({
        "major": major, "minor": minor, "gitVersion": format!("v{major}.{minor}.2"),
        "gitCommit": "abc", "gitTreeState": "clean", "buildDate": "2026-10-01T00:00:00Z",
        "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64",
    }))
}

/// The API server's answer to a delete that was accepted.
fn deleted() -> (StatusCode, String) {
    ok(json!({ "kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {} }))
}

impl MockApi {
    fn on(&self, method: Method, path: &str, answers: Vec<(StatusCode, String)>) -> &Self {
        self.routes.lock().unwrap().push(Route {
            method,
            path: path.into(),
            answers,
            served: 0,
            until: None,
        });
        self
    }

    /// Answers `before` in turn (the last repeats) until the route at `after.0` has served
    /// `after.1` requests, then `answers`.
    fn on_after(
        &self,
        method: Method,
        path: &str,
        before: Vec<(StatusCode, String)>,
        after: (&str, usize),
        answers: Vec<(StatusCode, String)>,
    ) -> &Self {
        self.routes.lock().unwrap().push(Route {
            method,
            path: path.into(),
            answers,
            served: 0,
            until: Some(Until {
                path: after.0.into(),
                count: after.1,
                before,
            }),
        });
        self
    }

    fn get(&self, path: &str, body: Value) -> &Self {
        self.on(Method::GET, path, vec![ok(body)])
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    /// A client whose every request this mock answers.
    fn kube(&self) -> Kube {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let me = self.clone();
        tokio::spawn(async move {
            let mut handle = std::pin::pin!(handle);
            while let Some((request, send)) = handle.next_request().await {
                let method = request.method().clone();
                let path = request.uri().path().to_string();
                let uri = request.uri().to_string();
                me.requests.lock().unwrap().push(format!("{method} {uri}"));
                let body = http_body_util::BodyExt::collect(request.into_body())
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    me.bodies.lock().unwrap().push(v);
                }
                let (code, text) = {
                    let mut routes = me.routes.lock().unwrap();
                    let served = |routes: &[Route], path: &str| {
                        routes
                            .iter()
                            .filter(|r| r.path == path)
                            .map(|r| r.served)
                            .sum::<usize>()
                    };
                    let waiting = routes
                        .iter()
                        .find(|r| r.method == method && r.path == path)
                        .and_then(|r| r.until.as_ref())
                        .is_some_and(|until| served(&routes, &until.path) < until.count);
                    match routes
                        .iter_mut()
                        .find(|r| r.method == method && r.path == path)
                    {
                        Some(Route {
                            until: Some(Until { before, .. }),
                            ..
                        }) if waiting => {
                            let answer = before.remove(0);
                            if before.is_empty() {
                                before.push(answer.clone());
                            }
                            answer
                        }
                        Some(route) => {
                            let i = route.served.min(route.answers.len() - 1);
                            route.served += 1;
                            route.answers[i].clone()
                        }
                        // What every real API server answers, unless a test says otherwise.
                        None if method == Method::GET && path == "/version" => {
                            version_info("1", "36")
                        }
                        None if method == Method::GET && path == "/api/v1/namespaces/default" => {
                            ok(json!({
                                "apiVersion": "v1", "kind": "Namespace",
                                "metadata": { "name": "default" },
                            }))
                        }
                        None if method == Method::GET && path.starts_with("/api/v1/nodes/") => {
                            ok(node(&path["/api/v1/nodes/".len()..], "True", ""))
                        }
                        None => not_found(&path),
                    }
                };
                let response = Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(text.into_bytes()))
                    .unwrap();
                send.send_response(response);
            }
        });
        Kube::new(kube::Client::new(service, "default"), "default")
            .with_poll(Duration::from_millis(20))
    }
}

const JOB: &str = "/apis/batch/v1/namespaces/default/jobs/cifar10";
const PYTORCHJOB: &str = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/cifar10";
const PODS: &str = "/api/v1/namespaces/default/pods";

fn job(status: Value) -> Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": { "name": "cifar10", "namespace": "default" },
        "spec": { "template": { "spec": { "containers": [] } } },
        "status": status,
    })
}

fn pod(index: u32, phase: &str, node: Option<&str>, status: Value) -> Value {
    let mut status = status;
    status["phase"] = json!(phase);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("cifar10-{index}-abcde"),
            "namespace": "default",
            "uid": format!("uid-{index}"),
            "labels": {
                "job-name": "cifar10",
                "batch.kubernetes.io/job-completion-index": index.to_string(),
                "trainctl.dev/job": "cifar10",
                "app.kubernetes.io/managed-by": "trainctl",
            },
        },
        "spec": { "containers": [{ "name": "pytorch" }], "nodeName": node },
        "status": status,
    })
}

fn running_container(restarts: i32) -> Value {
    json!({
        "name": "pytorch", "ready": true, "restartCount": restarts, "image": "trainctl",
        "imageID": "", "state": { "running": { "startedAt": "2026-11-21T10:00:00Z" } },
    })
}

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({ "apiVersion": "v1", "kind": kind, "metadata": {}, "items": items })
}

/// Empty lists of every kind `delete` looks through, as a real API server answers; routes added
/// before this one answer first.
fn empty_lists(api: &MockApi) {
    for (path, kind) in [
        ("/apis/batch/v1/namespaces/default/jobs", "JobList"),
        (
            "/apis/apps/v1/namespaces/default/deployments",
            "DeploymentList",
        ),
        ("/api/v1/namespaces/default/services", "ServiceList"),
        ("/api/v1/namespaces/default/secrets", "SecretList"),
    ] {
        api.get(path, list(kind, vec![]));
    }
}

fn project(flags: &[(&'static str, &str)]) -> Project {
    Project::from_settings(flags).unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn status_of_pods_not_yet_scheduled() {
    let api = MockApi::default();
    let unschedulable = json!({
        "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 1 node(s) had untolerated taint, 2 Insufficient cpu.",
        }],
    });
    api.get(JOB, job(json!({ "active": 2 })));
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(1, "Pending", None, unschedulable.clone()),
                pod(0, "Pending", None, unschedulable),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(status.phase, Phase::Pending, "active but nothing runs");
    assert_eq!(status.pods.len(), 2);
    assert_eq!(status.pods[0].index, Some(0), "sorted by node index");
    let text = status.render();
    assert!(text.contains("Job cifar10: pending"), "{text}");
    assert!(text.contains("(unscheduled)"), "{text}");
    assert!(
        text.contains("Unschedulable: 0/3 nodes are available: 1 node(s) had untolerated taint, 2 Insufficient cpu."),
        "{text}"
    );
}

#[tokio::test]
async fn status_of_a_restarting_pod() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 2, "failed": 1 })));
    let mut crashing = running_container(2);
    crashing["ready"] = json!(false);
    crashing["state"] = json!({ "waiting": { "reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container" } });
    crashing["lastState"] = json!({ "terminated": { "exitCode": 137, "reason": "OOMKilled" } });
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(
                    0,
                    "Running",
                    Some("ip-10-0-1-1"),
                    json!({ "containerStatuses": [running_container(0)], "podIP": "10.0.1.5" }),
                ),
                pod(
                    1,
                    "Running",
                    Some("ip-10-0-1-2"),
                    json!({ "containerStatuses": [crashing] }),
                ),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.pods[1].restarts, 2);
    assert!(!status.pods[1].ready);
    assert_eq!(status.pods[0].ip.as_deref(), Some("10.0.1.5"));
    let text = status.render();
    assert!(text.contains("failed pods so far: 1"), "{text}");
    assert!(
        text.contains("CrashLoopBackOff: back-off 20s restarting failed container; last run exited 137 (OOMKilled)"),
        "{text}"
    );
    assert!(text.contains("ip-10-0-1-2"), "{text}");
}

/// A pod deleted or evicted while the job runs: its `trainctl run` leaves the job at a step
/// boundary and exits 143, which the podFailurePolicy ignores (the Job's `status.failed` stays
/// 0), and the Job replaces it under the same index. `job status` says it left, not that it
/// failed, and shows none of its last lines as a failure's, while a container killed by the
/// kernel (137) beside it is still a failure.
#[tokio::test]
async fn a_pod_that_left_after_a_sigterm_is_not_a_failure() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 3, "failed": 1 })));
    let ended = |index, code: i32, reason: &str, message: &str| {
        let mut p = pod(
            index,
            "Failed",
            Some("n2"),
            json!({ "containerStatuses": [{
                "name": "pytorch", "ready": false, "restartCount": 0, "image": "trainctl",
                "imageID": "",
                "state": { "terminated": { "exitCode": code, "reason": reason, "message": message } },
            }] }),
        );
        p["metadata"]["name"] = json!(format!("cifar10-{index}-old"));
        p["metadata"]["uid"] = json!(format!("uid-{index}-old"));
        p
    };
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(
                    0,
                    "Running",
                    Some("n1"),
                    json!({ "containerStatuses": [running_container(0)] }),
                ),
                // FallbackToLogsOnError: the last log lines, as for any non-zero exit.
                ended(
                    1,
                    143,
                    "Error",
                    "node 1 leaves (SIGTERM)\nleft the job at step 1200",
                ),
                pod(
                    1,
                    "Running",
                    Some("n3"),
                    json!({ "containerStatuses": [running_container(0)] }),
                ),
                ended(2, 137, "OOMKilled", "epoch 3 step 40"),
                pod(2, "Pending", None, json!({})),
                ended(
                    3,
                    143,
                    "Error",
                    "node n4 is evicted as a straggler: node 3 (ranks 3) is a straggler: 2.5× \
                     the other nodes' time per step",
                ),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    let evicted = status
        .pods
        .iter()
        .find(|p| p.name == "cifar10-3-old")
        .unwrap();
    assert!(
        evicted
            .why
            .starts_with("node n4 is evicted as a straggler: node 3 (ranks 3)")
            && evicted.why.ends_with(
                "(exit 143: not a failure, never counted; the Job replaces the pod unless `job scale` removed its index)"
            ),
        "{}",
        evicted.why
    );
    let left = status
        .pods
        .iter()
        .find(|p| p.name == "cifar10-1-old")
        .unwrap();
    assert_eq!(
        left.why,
        "left the job (exit 143 after a SIGTERM: not a failure, never counted; the Job replaces \
         the pod unless `job scale` removed its index)"
    );
    assert_eq!(left.last_words, None);
    let text = status.render();
    assert!(!text.contains("cifar10-1-old failed"), "{text}");
    assert!(!text.contains("left the job at step 1200"), "{text}");
    assert!(!text.contains("exited 143"), "{text}");
    // Only the container the kernel killed is a failure (the Job's count says 1).
    assert!(text.contains("failed pods so far: 1"), "{text}");
    assert!(text.contains("exited 137 (OOMKilled)"), "{text}");
    assert!(
        text.contains("cifar10-2-old failed; its last lines:"),
        "{text}"
    );
    assert_eq!(status.phase, Phase::Running);
}

/// A node whose kubelet stopped (its Ready condition Unknown once the node controller notices,
/// or False) leaves its pods Running and ready in the API: status says the pod cannot be
/// reached but its workers may still run (a kubelet down for a while leaves them training), and
/// logs say why there are none instead of the API server's bare 500, then fail at the end.
#[tokio::test]
async fn a_pod_on_a_not_ready_node_is_unreachable_in_status_and_logs() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 3 })));
    let running = |index, node| {
        pod(
            index,
            "Running",
            Some(node),
            json!({ "containerStatuses": [running_container(0)] }),
        )
    };
    api.get(
        PODS,
        list(
            "PodList",
            vec![running(0, "n1"), running(1, "n2"), running(2, "n3")],
        ),
    );
    api.get(
        "/api/v1/nodes/n2",
        node("n2", "Unknown", "Kubelet stopped posting node status."),
    );
    api.get(
        "/api/v1/nodes/n3",
        node("n3", "False", "container runtime network not ready"),
    );
    api.on(
        Method::GET,
        "/api/v1/namespaces/default/pods/cifar10-0-abcde/log",
        vec![(
            StatusCode::OK,
            "2026-11-21T10:00:01.000000000Z step 1\n".into(),
        )],
    );
    let kube = api.kube();
    let status = kube.status("cifar10").await.unwrap();
    assert_eq!(status.phase, Phase::Running);
    assert!(status.pods[0].ready);
    assert!(!status.pods[1].ready && !status.pods[2].ready);
    let text = status.render();
    assert!(
        text.contains(
            "node n2 is unreachable (Kubelet stopped posting node status.): unreachable; its \
             workers may still be running"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "node n3 is NotReady (container runtime network not ready): unreachable; its workers \
             may still be running"
        ),
        "{text}"
    );
    assert!(!text.contains("lost"), "{text}");
    let mut lines = Vec::new();
    let e = kube
        .logs("cifar10", false, &mut |l: &str| lines.push(l.to_string()))
        .await
        .unwrap_err();
    assert_eq!(
        lines,
        [
            "[cifar10-0-abcde pod 0] step 1",
            "[cifar10-1-abcde pod 1] (no logs: node n2 is unreachable (Kubelet stopped posting \
             node status.), so its kubelet cannot serve them)",
            "[cifar10-2-abcde pod 2] (no logs: node n3 is NotReady (container runtime network \
             not ready), so its kubelet cannot serve them)",
        ]
    );
    assert!(matches!(e, ApiError::LogsMissing { .. }), "{e:?}");
    assert!(
        e.to_string()
            .starts_with("could not read the logs of 2 of the job's 3 pods"),
        "{e}"
    );
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.contains("cifar10-1-abcde/log") || r.contains("cifar10-2-abcde/log")),
        "a pod whose node is known to be down is not asked for: {:?}",
        api.requests()
    );
}

/// What the API server answers for the logs of a pod whose kubelet does not answer (the
/// ~40 s before its node turns NotReady): a 500 whose message is the kubelet's dial error.
fn kubelet_down(pod: &str) -> (StatusCode, String) {
    status(
        500,
        "",
        &format!(
            "Get \"https://10.0.1.12:10250/containerLogs/default/{pod}/pytorch?timestamps=true\": \
             dial tcp 10.0.1.12:10250: connect: connection refused"
        ),
    )
}

/// A kubelet that does not answer for one of two pods: the other pod's lines are all shown,
/// the unread pod is named with the kubelet's error, and only then does `job logs` fail, with
/// what to do (no Rust debug dump of the API's Status).
#[tokio::test]
async fn logs_go_on_past_a_pod_whose_kubelet_does_not_answer() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 2 })));
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(0, "Running", Some("n1"), json!({})),
                pod(1, "Running", Some("n2"), json!({})),
            ],
        ),
    );
    api.on(
        Method::GET,
        "/api/v1/namespaces/default/pods/cifar10-0-abcde/log",
        vec![(
            StatusCode::OK,
            "2026-11-21T10:00:01.000000000Z step 1\n2026-11-21T10:00:02.000000000Z step 2\n".into(),
        )],
    );
    api.on(
        Method::GET,
        "/api/v1/namespaces/default/pods/cifar10-1-abcde/log",
        vec![kubelet_down("cifar10-1-abcde")],
    );
    let mut lines = Vec::new();
    let e = api
        .kube()
        .logs("cifar10", false, &mut |l: &str| lines.push(l.to_string()))
        .await
        .unwrap_err();
    assert_eq!(
        lines,
        [
            "[cifar10-0-abcde pod 0] step 1",
            "[cifar10-0-abcde pod 0] step 2",
            "[cifar10-1-abcde pod 1] (no logs: the kubelet on node n2 did not answer (500: Get \
             \"https://10.0.1.12:10250/containerLogs/default/cifar10-1-abcde/pytorch?\
             timestamps=true\": dial tcp 10.0.1.12:10250: connect: connection refused))",
        ]
    );
    let text = e.to_string();
    assert!(
        text.starts_with(
            "could not read the logs of 1 of the job's 2 pods: cifar10-1-abcde (the \
             kubelet on node n2 did not answer (500: Get"
        ),
        "{text}"
    );
    assert!(text.contains("--follow"), "{text}");
    assert!(
        text.contains("trainctl job status --name cifar10 --namespace default"),
        "{text}"
    );
    assert!(!text.contains("Status {"), "{text}");
}

/// `--follow` reattaches to a pod whose stream ended while its container ran (the kubelet
/// restarted), waits while the kubelet does not answer (a 500) and says so, then resumes from
/// the last line's second without showing a line twice, and ends once the pod has.
#[tokio::test]
async fn follow_reattaches_when_a_stream_breaks_and_repeats_no_line() {
    let api = MockApi::default();
    const POD: &str = "/api/v1/namespaces/default/pods/cifar10-0-abcde";
    const LOG: &str = "/api/v1/namespaces/default/pods/cifar10-0-abcde/log";
    let running = job(json!({ "active": 1 }));
    let done =
        job(json!({ "succeeded": 1, "conditions": [{ "type": "Complete", "status": "True" }] }));
    // The job completes once its pod has: after the fourth look at the pod.
    api.on_after(
        Method::GET,
        JOB,
        vec![ok(running)],
        (POD, 4),
        vec![ok(done)],
    );
    let training = pod(
        0,
        "Running",
        Some("n1"),
        json!({ "containerStatuses": [running_container(0)] }),
    );
    api.get(PODS, list("PodList", vec![training.clone()]));
    let mut finished = pod(0, "Succeeded", Some("n1"), json!({}));
    finished["status"]["containerStatuses"] = json!([{
        "name": "pytorch", "ready": false, "restartCount": 0, "image": "trainctl", "imageID": "",
        "state": { "terminated": { "exitCode": 0, "reason": "Completed" } },
    }]);
    // A stream that ended cleanly looks at its pod twice (the status may lag the container's
    // exit by a moment); one that broke, once.
    api.on(
        Method::GET,
        POD,
        vec![ok(&training), ok(&training), ok(&training), ok(&finished)],
    );
    let from_second_2 = "2026-11-21T10:00:02.100000000Z step 2\n\
                         2026-11-21T10:00:02.600000000Z step 3\n\
                         2026-11-21T10:00:03.000000000Z done\n";
    api.on(
        Method::GET,
        LOG,
        vec![
            // The stream ends while the container runs: its kubelet restarted.
            (
                StatusCode::OK,
                "2026-11-21T10:00:01.000000000Z step 1\n2026-11-21T10:00:02.100000000Z step 2\n"
                    .into(),
            ),
            // The kubelet does not answer yet.
            kubelet_down("cifar10-0-abcde"),
            // Back: the stream from the last line's second, which repeats step 2.
            (StatusCode::OK, from_second_2.into()),
        ],
    );
    let mut lines = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        api.kube()
            .logs("cifar10", true, &mut |l: &str| lines.push(l.to_string())),
    )
    .await
    .expect("follow ends once the job has finished")
    .unwrap();
    let prefix = "[cifar10-0-abcde pod 0] ";
    let training_lines: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter(|l| !l.starts_with('('))
        .collect();
    assert_eq!(
        training_lines,
        ["step 1", "step 2", "step 3", "done"],
        "{lines:#?}"
    );
    let said: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter(|l| l.starts_with('('))
        .collect();
    assert_eq!(said.len(), 3, "{lines:#?}");
    assert!(
        said[0]
            .starts_with("(logs interrupted: the log stream ended while the container still runs")
            && said[0].contains("waiting for the kubelet to answer again, trying every"),
        "{said:#?}"
    );
    assert!(
        said[1].starts_with(
            "(logs interrupted: the kubelet on node n1 did not answer (500: Get \"https://"
        ),
        "{said:#?}"
    );
    assert!(said[2].starts_with("(reattached after "), "{said:#?}");
    for line in &lines {
        assert!(
            !line.contains("Status {") && !line.contains("ApiError"),
            "{line}"
        );
    }
    let logs: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.contains("/log?"))
        .collect();
    assert_eq!(logs.len(), 4, "three streams and a last read: {logs:#?}");
    assert!(!logs[0].contains("sinceTime"), "{logs:#?}");
    for reopened in &logs[1..] {
        assert!(
            reopened.contains("sinceTime=2026-11-21T10%3A00%3A02Z")
                || reopened.contains("sinceTime=2026-11-21T10%3A00%3A03Z"),
            "{logs:#?}"
        );
        assert!(reopened.contains("timestamps=true"), "{logs:#?}");
    }
    assert!(
        logs[..3].iter().all(|r| r.contains("follow=true")) && !logs[3].contains("follow=true"),
        "the last read, once the container has ended, does not follow: {logs:#?}"
    );
}

/// A pod whose kubelet never answers again does not keep `--follow` waiting past the job's end.
#[tokio::test]
async fn follow_stops_waiting_for_a_kubelet_when_the_job_has_finished() {
    let api = MockApi::default();
    const LOG: &str = "/api/v1/namespaces/default/pods/cifar10-0-abcde/log";
    let running = job(json!({ "active": 1 }));
    let done =
        job(json!({ "succeeded": 1, "conditions": [{ "type": "Complete", "status": "True" }] }));
    api.on_after(
        Method::GET,
        JOB,
        vec![ok(running)],
        (LOG, 2),
        vec![ok(done)],
    );
    let training = pod(
        0,
        "Running",
        Some("n1"),
        json!({ "containerStatuses": [running_container(0)] }),
    );
    api.get(PODS, list("PodList", vec![training.clone()]));
    api.get("/api/v1/namespaces/default/pods/cifar10-0-abcde", training);
    api.on(Method::GET, LOG, vec![kubelet_down("cifar10-0-abcde")]);
    let mut lines = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        api.kube()
            .logs("cifar10", true, &mut |l: &str| lines.push(l.to_string())),
    )
    .await
    .expect("follow ends once the job has finished")
    .unwrap();
    let last = lines.last().unwrap();
    assert!(
        last.starts_with(
            "[cifar10-0-abcde pod 0] (no more logs from this pod: the job has finished, and the \
             kubelet on node n1 did not answer (500: Get"
        ),
        "{lines:#?}"
    );
}

/// `job logs` while every pod is still pending says so, and why, instead of printing nothing.
#[tokio::test]
async fn logs_of_a_job_whose_pods_have_not_started_say_why() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 1 })));
    let unschedulable = json!({
        "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector.",
        }],
    });
    api.get(
        PODS,
        list("PodList", vec![pod(0, "Pending", None, unschedulable)]),
    );
    let e = api
        .kube()
        .logs("cifar10", false, &mut |_: &str| {})
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("no pod of job cifar10 has started yet"),
        "{text}"
    );
    assert!(
        text.contains("didn't match Pod's node affinity/selector"),
        "{text}"
    );
}

#[tokio::test]
async fn a_failed_job_says_why_and_wait_returns_it() {
    let api = MockApi::default();
    let running = job(json!({ "active": 2 }));
    let failed = job(json!({
        "failed": 1,
        "conditions": [{
            "type": "Failed", "status": "True", "reason": "PodFailurePolicy",
            "message": "Container pytorch for pod default/cifar10-1-abcde failed with exit code 1 matching FailJob rule at index 1",
        }],
    }));
    api.on(
        Method::GET,
        JOB,
        vec![ok(running.clone()), ok(running), ok(failed)],
    );
    let mut terminated = running_container(0);
    terminated["ready"] = json!(false);
    terminated["state"] = json!({ "terminated": { "exitCode": 1, "reason": "Error" } });
    api.get(
        PODS,
        list(
            "PodList",
            vec![pod(
                1,
                "Failed",
                Some("n1"),
                json!({ "containerStatuses": [terminated] }),
            )],
        ),
    );
    let kube = api.kube();
    let status = kube.wait("cifar10", Duration::from_secs(30)).await.unwrap();
    assert_eq!(status.phase, Phase::Failed);
    let failure = status.failure().unwrap();
    assert_eq!(failure.reason, "PodFailurePolicy");
    let text = status.render();
    assert!(
        text.contains("condition Failed (PodFailurePolicy): Container pytorch"),
        "{text}"
    );
    assert!(text.contains("exited 1 (Error)"), "{text}");
    // It polled until the job had failed.
    let polls = api
        .requests()
        .iter()
        .filter(|r| r.starts_with(&format!("GET {JOB}")))
        .count();
    assert!(polls >= 3, "{polls}");
}

/// A binary that cannot start (its loader lacks a library: exit 127) fails the job at once by
/// the FailJob rule; `status` and `wait` show the container's last lines (its termination
/// message, from `FallbackToLogsOnError`), colour codes stripped.
#[tokio::test]
async fn a_container_that_cannot_start_shows_its_last_lines() {
    let api = MockApi::default();
    api.get(
        JOB,
        job(json!({
            "failed": 1,
            "conditions": [{
                "type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                "message": "Container trainctl for pod default/cifar10-0-abcde failed with exit code 127 matching FailJob rule at index 2",
            }],
        })),
    );
    let mut terminated = running_container(0);
    terminated["ready"] = json!(false);
    let lines: Vec<String> = (0..30).map(|i| format!("line {i}")).collect();
    let message = format!(
        "{}\n\u{1b}[31m/opt/trainctl/trainctl: error while loading shared libraries: libgcc_s.so.1: cannot open shared object file: No such file or directory\u{1b}[0m\n",
        lines.join("\n")
    );
    terminated["state"] =
        json!({ "terminated": { "exitCode": 127, "reason": "Error", "message": message } });
    api.get(
        PODS,
        list(
            "PodList",
            vec![pod(
                0,
                "Failed",
                Some("n1"),
                json!({ "containerStatuses": [terminated] }),
            )],
        ),
    );
    let status = api
        .kube()
        .wait("cifar10", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(status.phase, Phase::Failed);
    let text = status.render();
    assert!(text.contains("exited 127 (Error)"), "{text}");
    assert!(
        text.contains("cifar10-0-abcde failed; its last lines:"),
        "{text}"
    );
    assert!(
        text.contains(
            "    /opt/trainctl/trainctl: error while loading shared libraries: libgcc_s.so.1"
        ),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "{text}");
    // The last ten lines only: the first screen, not the whole log.
    assert!(
        text.contains("line 29") && !text.contains("line 20\n"),
        "{text}"
    );
}

/// `trainctl run --termination-log` leaves the root cause in each failed pod's termination
/// message: `job status` shows it, once for the whole job, without kubectl; a running pod that
/// restarted shows its last run's.
#[tokio::test]
async fn status_shows_the_root_cause_from_the_termination_message() {
    let report = "trainctl run: the job failed; root cause (first failure):\non node cifar10-1: rank 1 (pid 42) failed: ValueError: bad shard 7 at /job/train.py:12 in load; the other workers were stopped\nroot cause (first failure):\n  rank       : 1 (local rank 0, node 1)\n  error      : ValueError: bad shard 7\n  traceback  : (innermost last)\n    /job/train.py:20 in main: load(7)\n    /job/train.py:12 in load: raise ValueError(f\"bad shard {n}\")\n";
    let api = MockApi::default();
    api.get(
        JOB,
        job(json!({
            "failed": 2,
            "conditions": [{ "type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": "failed with exit code 1" }],
        })),
    );
    let failed = |i: u32| {
        let mut c = running_container(0);
        c["ready"] = json!(false);
        c["state"] =
            json!({ "terminated": { "exitCode": 1, "reason": "Error", "message": report } });
        pod(i, "Failed", Some("n1"), json!({ "containerStatuses": [c] }))
    };
    api.get(PODS, list("PodList", vec![failed(0), failed(1)]));
    let text = api.kube().status("cifar10").await.unwrap().render();
    assert_eq!(
        text.matches("the root cause, as trainctl run reported it:")
            .count(),
        1,
        "one report for the job: {text}"
    );
    for expected in [
        "rank 1 (pid 42) failed: ValueError: bad shard 7 at /job/train.py:12 in load",
        "  error      : ValueError: bad shard 7",
        "/job/train.py:12 in load: raise ValueError",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    assert!(!text.contains("its last lines"), "{text}");

    // A pod restarted after a failure: its last run's report.
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 1 })));
    let mut c = running_container(1);
    c["lastState"] =
        json!({ "terminated": { "exitCode": 1, "reason": "Error", "message": report } });
    api.get(
        PODS,
        list(
            "PodList",
            vec![pod(
                0,
                "Running",
                Some("n1"),
                json!({ "containerStatuses": [c] }),
            )],
        ),
    );
    let text = api.kube().status("cifar10").await.unwrap().render();
    assert!(text.contains("ValueError: bad shard 7"), "{text}");
}

#[tokio::test]
async fn wait_gives_up_at_its_deadline() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 1 })));
    api.get(PODS, list("PodList", vec![]));
    let e = api
        .kube()
        .wait("cifar10", Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(e, ApiError::WaitTimeout { .. }), "{e}");
    assert!(e.to_string().contains("still pending"), "{e}");
}

#[tokio::test]
async fn a_pytorchjob_is_found_when_there_is_no_job() {
    let api = MockApi::default();
    api.get(
        PYTORCHJOB,
        json!({
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": { "name": "cifar10", "namespace": "default" },
            "spec": {},
            "status": { "conditions": [
                { "type": "Created", "status": "True", "reason": "PyTorchJobCreated" },
                { "type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded", "message": "PyTorchJob default/cifar10 successfully completed." },
            ] },
        }),
    );
    api.get(PODS, list("PodList", vec![]));
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(status.kind, "PyTorchJob");
    assert_eq!(status.phase, Phase::Succeeded);
    assert!(!status.render().contains("nothing has picked"));
}

/// A PyTorchJob that no operator reconciles has no condition at all: say so rather than
/// "pending" forever.
#[tokio::test]
async fn a_pytorchjob_nobody_reconciles_says_so() {
    let api = MockApi::default();
    api.get(
        PYTORCHJOB,
        json!({
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": { "name": "cifar10", "namespace": "default" },
            "spec": {},
        }),
    );
    api.get(PODS, list("PodList", vec![]));
    let text = api.kube().status("cifar10").await.unwrap().render();
    assert!(text.contains("PyTorchJob cifar10: pending"), "{text}");
    assert!(
        text.contains(
            "nothing has picked this PyTorchJob up; is the Kubeflow training operator running?"
        ),
        "{text}"
    );
}

const TRAINJOB: &str = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs/cifar10";
const MPIJOB: &str = "/apis/kubeflow.org/v2beta1/namespaces/default/mpijobs/cifar10";

/// A pod of an operator's job: `labels` say whose and which.
fn operator_pod(name: &str, labels: Value, container: &str) -> Value {
    let mut labels = labels;
    labels["trainctl.dev/job"] = json!("cifar10");
    labels["app.kubernetes.io/managed-by"] = json!("trainctl");
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default", "uid": name, "labels": labels },
        "spec": { "containers": [{ "name": container }], "nodeName": "n1" },
        "status": { "phase": "Running", "containerStatuses": [{
            "name": container, "ready": true, "restartCount": 0, "image": "trainctl",
            "imageID": "", "state": { "running": { "startedAt": "2026-11-21T10:00:00Z" } },
        }] },
    })
}

/// A TrainJob is found where no Job or PyTorchJob is (each answers 404 as a server without
/// them does), with Trainer's conditions, and its JobSet's pods are its own, by node index.
#[tokio::test]
async fn a_trainjob_is_found_with_its_jobset_pods() {
    let api = MockApi::default();
    api.get(
        TRAINJOB,
        json!({
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": { "name": "cifar10", "namespace": "default" },
            "spec": {},
            "status": { "conditions": [
                { "type": "Created", "status": "True", "reason": "JobsCreationSucceeded" },
                { "type": "Complete", "status": "True", "reason": "JobsCompleted", "message": "jobset completed" },
            ] },
        }),
    );
    let node = |i: u32| {
        operator_pod(
            &format!("cifar10-node-0-{i}-x"),
            json!({
                "jobset.sigs.k8s.io/jobset-name": "cifar10",
                "batch.kubernetes.io/job-name": "cifar10-node-0",
                "batch.kubernetes.io/job-completion-index": i.to_string(),
            }),
            "node",
        )
    };
    api.get(PODS, list("PodList", vec![node(1), node(0)]));
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(status.kind, "TrainJob");
    assert_eq!(status.phase, Phase::Succeeded);
    let pods: Vec<(&str, Option<u32>)> = status
        .pods
        .iter()
        .map(|p| (p.name.as_str(), p.index))
        .collect();
    assert_eq!(
        pods,
        [
            ("cifar10-node-0-0-x", Some(0)),
            ("cifar10-node-0-1-x", Some(1))
        ]
    );
    assert_eq!(status.pods[0].container, "node");
}

#[tokio::test]
async fn a_trainjob_nobody_reconciles_names_trainer() {
    let api = MockApi::default();
    api.get(
        TRAINJOB,
        json!({
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": { "name": "cifar10", "namespace": "default" }, "spec": {},
        }),
    );
    api.get(PODS, list("PodList", vec![]));
    let text = api.kube().status("cifar10").await.unwrap().render();
    assert!(
        text.contains("nothing has picked this TrainJob up; is Kubeflow Trainer v2 running?")
            && text.contains("trainer-controller-manager"),
        "{text}"
    );
    // `job wait` gives up saying the same, not only "pending".
    let e = api
        .kube()
        .wait("cifar10", Duration::from_millis(50))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("nothing has picked this TrainJob up"), "{e}");
}

/// An MPIJob's launcher pod comes before its workers (it has no node index): its lines and
/// its root cause are the run's.
#[tokio::test]
async fn an_mpijob_shows_its_launcher_first() {
    let api = MockApi::default();
    api.get(
        MPIJOB,
        json!({
            "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
            "metadata": { "name": "cifar10", "namespace": "default" }, "spec": {},
            "status": { "conditions": [
                { "type": "Created", "status": "True" },
                { "type": "Running", "status": "True" },
            ] },
        }),
    );
    let pod = |name: &str, role: &str, index: u32| {
        operator_pod(
            name,
            json!({
                "training.kubeflow.org/job-name": "cifar10",
                "training.kubeflow.org/job-role": role,
                "training.kubeflow.org/replica-index": index.to_string(),
            }),
            role,
        )
    };
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod("cifar10-worker-1", "worker", 1),
                pod("cifar10-worker-0", "worker", 0),
                pod("cifar10-launcher-abcde", "launcher", 0),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(
        (status.kind.as_str(), status.phase),
        ("MPIJob", Phase::Running)
    );
    let names: Vec<&str> = status.pods.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "cifar10-launcher-abcde",
            "cifar10-worker-0",
            "cifar10-worker-1"
        ]
    );
}

#[tokio::test]
async fn no_such_job() {
    let api = MockApi::default();
    let e = api.kube().status("cifar10").await.unwrap_err();
    assert!(matches!(e, ApiError::NoJob { .. }), "{e}");
    assert!(e.to_string().contains("trainctl job launch"), "{e}");
}

#[tokio::test]
async fn api_errors_are_reported_with_their_code_and_what_to_do() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 1 })));
    api.on(
        Method::GET,
        PODS,
        vec![status(
            500,
            "InternalError",
            "etcdserver: request timed out",
        )],
    );
    let e = api.kube().status("cifar10").await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "list pods: the API server answered 500 InternalError: etcdserver: request timed out"
    );

    let api = MockApi::default();
    api.on(
        Method::GET,
        JOB,
        vec![status(
            403,
            "Forbidden",
            "jobs.batch \"cifar10\" is forbidden: User \"dev\" cannot get resource \"jobs\"",
        )],
    );
    let e = api.kube().status("cifar10").await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("get Job cifar10: forbidden: jobs.batch"),
        "{text}"
    );
    assert!(text.contains("RBAC permission"), "{text}");
}

#[tokio::test]
async fn top_without_the_metrics_api_says_install_metrics_server() {
    let api = MockApi::default();
    api.get(
        PODS,
        list(
            "PodList",
            vec![pod(
                0,
                "Running",
                Some("n1"),
                json!({ "containerStatuses": [running_container(0)] }),
            )],
        ),
    );
    // No route for /apis/metrics.k8s.io: a 404, as when metrics-server is not installed.
    let e = api.kube().top("cifar10").await.unwrap_err();
    assert!(matches!(e, ApiError::MetricsMissing), "{e}");
    assert!(e.to_string().contains("install metrics-server"), "{e}");
    // An installed but unavailable metrics-server answers 503: the same advice.
    let api = MockApi::default();
    api.get(PODS, list("PodList", vec![]));
    api.get(JOB, job(json!({})));
    api.on(
        Method::GET,
        "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods",
        vec![status(
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        )],
    );
    let e = api.kube().top("cifar10").await.unwrap_err();
    assert!(matches!(e, ApiError::MetricsMissing), "{e}");
}

#[tokio::test]
async fn top_shows_pods_and_their_nodes() {
    let api = MockApi::default();
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(
                    0,
                    "Running",
                    Some("n1"),
                    json!({ "containerStatuses": [running_container(0)] }),
                ),
                pod(1, "Pending", None, json!({})),
            ],
        ),
    );
    api.get(
        "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods",
        json!({ "items": [{
            "metadata": { "name": "cifar10-0-abcde" },
            "containers": [{ "name": "pytorch", "usage": { "cpu": "1500000000n", "memory": "2097152Ki" } }],
        }] }),
    );
    api.get(
        "/apis/metrics.k8s.io/v1beta1/nodes",
        json!({ "items": [
            { "metadata": { "name": "n1" }, "usage": { "cpu": "2", "memory": "4Gi" } },
            { "metadata": { "name": "other" }, "usage": { "cpu": "1", "memory": "1Gi" } },
        ] }),
    );
    api.get(
        "/api/v1/nodes",
        list(
            "NodeList",
            vec![json!({
                "metadata": { "name": "n1" },
                "status": { "allocatable": { "cpu": "8", "memory": "16Gi" } },
            })],
        ),
    );
    let top = api.kube().top("cifar10").await.unwrap();
    assert_eq!(top.pods[0].millicores, Some(1500));
    assert_eq!(top.pods[0].bytes, Some(2 << 30));
    assert_eq!(top.pods[1].millicores, None, "a pending pod has no usage");
    assert_eq!(top.nodes.len(), 1, "only the job's nodes");
    let text = top.render();
    assert!(text.contains("1500m"), "{text}");
    assert!(text.contains("2048Mi"), "{text}");
    assert!(text.contains("25%"), "{text}");
}

#[tokio::test]
async fn launch_applies_each_object_server_side() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    for doc in &docs {
        let path = match doc["kind"].as_str().unwrap() {
            "Secret" => "/api/v1/namespaces/default/secrets/cifar10-token",
            "Service" => "/api/v1/namespaces/default/services/cifar10",
            "Job" => JOB,
            k => panic!("{k}"),
        };
        let mut stored = doc.clone();
        stored["metadata"]["uid"] = json!(format!("uid-{}", doc["kind"].as_str().unwrap()));
        api.on(Method::PATCH, path, vec![ok(stored)]);
    }
    let applied = api.kube().launch("cifar10", &docs).await.unwrap();
    let kinds: Vec<&str> = applied.iter().map(|a| a.kind.as_str()).collect();
    assert_eq!(kinds, ["Secret", "Service", "Job"]);
    let requests = api.requests();
    // The cluster is asked what the job needs before anything is written.
    let first_patch = requests
        .iter()
        .position(|r| r.starts_with("PATCH"))
        .unwrap();
    assert!(
        requests[..first_patch].iter().any(|r| r == "GET /version")
            && requests[..first_patch]
                .iter()
                .any(|r| r == "GET /api/v1/namespaces/default"),
        "{requests:?}"
    );
    let patches: Vec<String> = requests
        .into_iter()
        .filter(|r| r.starts_with("PATCH"))
        .collect();
    // The three objects, then the Secret and the Service again, owned by the Job: the garbage
    // collector removes them with it (and with its TTL).
    assert_eq!(patches.len(), 5, "{patches:?}");
    let bodies = api.bodies.lock().unwrap().clone();
    for owned in &bodies[3..] {
        assert_eq!(
            owned["metadata"]["ownerReferences"],
            json!([{ "apiVersion": "batch/v1", "kind": "Job", "name": "cifar10", "uid": "uid-Job" }]),
            "{owned}"
        );
    }
    assert_eq!(bodies[3]["kind"], "Secret");
    assert_eq!(bodies[4]["kind"], "Service");
    for p in &patches {
        assert!(
            p.contains("fieldManager=trainctl") && p.contains("force=true"),
            "{p}"
        );
    }
    // The bodies sent are the rendered objects.
    assert_eq!(bodies[2]["spec"]["completionMode"], "Indexed");
}

/// A server too old for the Job's fields, or a namespace that does not exist, is said before
/// anything is written.
#[tokio::test]
async fn launch_checks_the_server_and_the_namespace_first() {
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("T"));
    let api = MockApi::default();
    api.on(Method::GET, "/version", vec![version_info("1", "25+")]);
    let e = api.kube().launch("cifar10", &docs).await.unwrap_err();
    assert!(matches!(e, ApiError::TooOld { .. }), "{e}");
    assert!(
        e.to_string().contains("Kubernetes v1.25+.2") && e.to_string().contains("needs 1.26"),
        "{e}"
    );
    assert!(!api.requests().iter().any(|r| r.starts_with("PATCH")));

    let api = MockApi::default();
    api.on(
        Method::GET,
        "/api/v1/namespaces/default",
        vec![not_found("namespaces \"default\"")],
    );
    let e = api.kube().launch("cifar10", &docs).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "namespace default does not exist: create it (`kubectl create namespace default`) or \
         pass another --namespace"
    );
    assert!(!api.requests().iter().any(|r| r.starts_with("PATCH")));
}

/// A launch refused half-way (here the Job, by the API server's validation) removes what it
/// had applied: no token or Service is left behind for `job status` to call "no job".
#[tokio::test]
async fn a_launch_refused_half_way_removes_what_it_applied() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("T"));
    let secret = "/api/v1/namespaces/default/secrets/cifar10-token";
    let service = "/api/v1/namespaces/default/services/cifar10";
    api.on(Method::PATCH, secret, vec![ok(docs[0].clone())]);
    api.on(Method::PATCH, service, vec![ok(docs[1].clone())]);
    api.on(
        Method::PATCH,
        JOB,
        vec![status(
            422,
            "Invalid",
            "Job.batch \"cifar10\" is invalid: spec.podFailurePolicy: Forbidden",
        )],
    );
    api.on(Method::DELETE, secret, vec![deleted()]);
    api.on(Method::DELETE, service, vec![deleted()]);
    let e = api.kube().launch("cifar10", &docs).await.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("answered 422 Invalid"), "{text}");
    assert!(
        text.ends_with(
            "removed what this launch had applied (Service cifar10, Secret cifar10-token)"
        ),
        "{text}"
    );
    let deletes: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("DELETE"))
        .collect();
    assert_eq!(deletes.len(), 2, "{deletes:?}");
}

#[tokio::test]
async fn launch_refuses_to_replace_an_existing_job() {
    let api = MockApi::default();
    api.get(
        JOB,
        job(json!({ "succeeded": 2, "conditions": [{ "type": "Complete", "status": "True" }] })),
    );
    let p = project(&[("storage.efs", "fs-1")]);
    let e = api
        .kube()
        .launch(
            "cifar10",
            &launchers::training_job(&p, launchers::Token::Value("T")),
        )
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "job cifar10 already exists in namespace default (succeeded); delete it first with \
         `trainctl job delete --name cifar10`, or give another --name"
    );
    assert!(!api.requests().iter().any(|r| r.starts_with("PATCH")));
}

#[tokio::test]
async fn launching_a_pytorchjob_without_the_operator_says_install_it() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1"), ("job.launcher", "pytorchjob")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("T"));
    api.on(
        Method::PATCH,
        "/api/v1/namespaces/default/secrets/cifar10-token",
        vec![ok(docs[0].clone())],
    );
    // The CRD is missing: the API server answers 404 for the group's discovery and the whole
    // resource path. Nothing is written (the token Secret was, before the check came first).
    let e = api.kube().launch("cifar10", &docs).await.unwrap_err();
    assert!(!api.requests().iter().any(|r| r.starts_with("PATCH")));
    let text = e.to_string();
    assert!(
        text.starts_with("the cluster does not serve kubeflow.org/v1 PyTorchJob"),
        "{text}"
    );
    assert!(
        text.contains("install the Kubeflow training operator"),
        "{text}"
    );
    assert!(text.contains("--launcher indexed"), "{text}");
}

/// A TrainJob's launch checks Trainer's CRDs (its runtime's and its own) before writing
/// anything, and says which operator to install.
#[tokio::test]
async fn launching_a_trainjob_without_trainer_says_install_it() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1"), ("job.launcher", "trainjob")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("T"));
    let e = api.kube().launch("cifar10", &docs).await.unwrap_err();
    assert!(!api.requests().iter().any(|r| r.starts_with("PATCH")));
    let text = e.to_string();
    assert!(
        text.starts_with(
            "the cluster does not serve trainer.kubeflow.org/v1alpha1 TrainingRuntime"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "install Kubeflow Trainer v2 (`trainctl cluster addons --launcher trainjob` says how)"
        ),
        "{text}"
    );
    // Served: the runtime is applied first, then the TrainJob, which owns it and the Secret.
    api.get(
        "/apis/trainer.kubeflow.org/v1alpha1",
        json!({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "trainer.kubeflow.org/v1alpha1",
            "resources": [
                { "name": "trainjobs", "singularName": "trainjob", "namespaced": true, "kind": "TrainJob", "verbs": ["get", "patch"] },
                { "name": "trainingruntimes", "singularName": "trainingruntime", "namespaced": true, "kind": "TrainingRuntime", "verbs": ["get", "patch"] },
            ],
        }),
    );
    for doc in &docs {
        let mut stored = doc.clone();
        stored["metadata"]["uid"] = json!(format!("uid-{}", doc.kind()));
        let path = match doc.kind() {
            "Secret" => "/api/v1/namespaces/default/secrets/cifar10-token".to_string(),
            "TrainingRuntime" => {
                "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainingruntimes/cifar10"
                    .into()
            }
            _ => TRAINJOB.into(),
        };
        api.on(Method::PATCH, &path, vec![ok(stored.to_string())]);
    }
    let applied = api.kube().launch("cifar10", &docs).await.unwrap();
    let kinds: Vec<&str> = applied.iter().map(|a| a.kind.as_str()).collect();
    assert_eq!(kinds, ["Secret", "TrainingRuntime", "TrainJob"]);
    let bodies = api.bodies.lock().unwrap().clone();
    let owned = bodies
        .iter()
        .filter(|b| b["metadata"]["ownerReferences"][0]["kind"] == "TrainJob")
        .count();
    assert_eq!(
        owned, 2,
        "the Secret and the runtime go with the TrainJob: {bodies:?}"
    );
}

#[tokio::test]
async fn delete_removes_the_job_and_its_helpers_but_not_the_storage() {
    let api = MockApi::default();
    let named = |kind: &str, name: &str| json!({ "apiVersion": "v1", "kind": kind, "metadata": { "name": name, "namespace": "default" } });
    api.get(
        "/apis/batch/v1/namespaces/default/jobs",
        list(
            "JobList",
            vec![named("Job", "cifar10"), named("Job", "cifar10-test")],
        ),
    );
    api.get(
        "/api/v1/namespaces/default/services",
        list("ServiceList", vec![named("Service", "cifar10")]),
    );
    api.get(
        "/api/v1/namespaces/default/secrets",
        list("SecretList", vec![named("Secret", "cifar10-token")]),
    );
    for path in [
        JOB,
        "/apis/batch/v1/namespaces/default/jobs/cifar10-test",
        "/api/v1/namespaces/default/services/cifar10",
        "/api/v1/namespaces/default/secrets/cifar10-token",
    ] {
        api.on(Method::DELETE, path, vec![deleted()]);
    }
    empty_lists(&api);
    let deleted = api.kube().delete("cifar10").await.unwrap();
    let names: Vec<String> = deleted
        .iter()
        .map(|d| format!("{} {}", d.kind, d.name))
        .collect();
    assert_eq!(
        names,
        [
            "Job cifar10",
            "Job cifar10-test",
            "Service cifar10",
            "Secret cifar10-token"
        ]
    );
    let requests = api.requests();
    assert!(
        requests.iter().all(|r| !r.contains("persistentvolume")),
        "{requests:?}"
    );
    // Lists are by the job's labels, and deletes take the pods with them.
    assert!(
        requests
            .iter()
            .any(|r| r.contains("labelSelector=trainctl.dev%2Fjob%3Dcifar10")),
        "{requests:?}"
    );
    let bodies = api.bodies.lock().unwrap().clone();
    assert!(
        bodies
            .iter()
            .all(|b| b["propagationPolicy"] == "Background"),
        "{bodies:?}"
    );
}

#[tokio::test]
async fn logs_are_merged_in_time_order_with_pod_and_node() {
    let api = MockApi::default();
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(0, "Running", Some("n1"), json!({})),
                pod(1, "Running", Some("n2"), json!({})),
                pod(2, "Pending", None, json!({})),
            ],
        ),
    );
    api.on(
        Method::GET,
        "/api/v1/namespaces/default/pods/cifar10-0-abcde/log",
        vec![(StatusCode::OK, "2026-11-21T10:00:01.000000000Z epoch 1 step 10\n2026-11-21T10:00:03.000000000Z epoch 1 step 20\n".into())],
    );
    api.on(
        Method::GET,
        "/api/v1/namespaces/default/pods/cifar10-1-abcde/log",
        vec![(
            StatusCode::OK,
            "2026-11-21T10:00:02.000000000Z joined round 1\n".into(),
        )],
    );
    let mut lines = Vec::new();
    api.kube()
        .logs("cifar10", false, &mut |l: &str| lines.push(l.to_string()))
        .await
        .unwrap();
    assert_eq!(
        lines,
        [
            "[cifar10-0-abcde pod 0] epoch 1 step 10",
            "[cifar10-1-abcde pod 1] joined round 1",
            "[cifar10-0-abcde pod 0] epoch 1 step 20",
        ]
    );
    assert!(
        api.requests()
            .iter()
            .any(|r| r.contains("container=pytorch") && r.contains("timestamps=true"))
    );
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.contains("cifar10-2-abcde/log")),
        "a pending pod has no logs yet"
    );
}

#[tokio::test]
async fn follow_streams_until_the_job_has_finished() {
    let api = MockApi::default();
    let running = job(json!({ "active": 1 }));
    let done =
        job(json!({ "succeeded": 1, "conditions": [{ "type": "Complete", "status": "True" }] }));
    api.on(Method::GET, JOB, vec![ok(running), ok(done)]);
    api.get(
        PODS,
        list("PodList", vec![pod(0, "Running", Some("n1"), json!({}))]),
    );
    api.on(
        Method::GET,
        "/api/v1/namespaces/default/pods/cifar10-0-abcde/log",
        vec![(
            StatusCode::OK,
            "2026-11-21T10:00:01.000000000Z training\n2026-11-21T10:00:02.000000000Z done\n".into(),
        )],
    );
    let mut finished = pod(0, "Succeeded", Some("n1"), json!({}));
    finished["status"]["containerStatuses"] = json!([{
        "name": "pytorch", "ready": false, "restartCount": 0, "image": "trainctl", "imageID": "",
        "state": { "terminated": { "exitCode": 0, "reason": "Completed" } },
    }]);
    api.get("/api/v1/namespaces/default/pods/cifar10-0-abcde", finished);
    let mut lines = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        api.kube()
            .logs("cifar10", true, &mut |l: &str| lines.push(l.to_string())),
    )
    .await
    .expect("follow ends once the job has finished")
    .unwrap();
    assert_eq!(
        lines,
        [
            "[cifar10-0-abcde pod 0] training",
            "[cifar10-0-abcde pod 0] done"
        ]
    );
    let streams = api
        .requests()
        .iter()
        .filter(|r| r.contains("/log?") && r.contains("follow=true"))
        .count();
    assert_eq!(streams, 1, "one stream per pod, not one per poll");
    let reads = api
        .requests()
        .iter()
        .filter(|r| r.contains("/log?") && !r.contains("follow=true"))
        .count();
    assert_eq!(
        reads, 1,
        "one last read once the container has ended, whose lines were all shown already"
    );
}

/// With `--rdzv-backend etcd` the job's etcd (Service, then Deployment) is applied before the
/// job, so that its name resolves when the first pod starts.
#[tokio::test]
async fn launch_with_etcd_applies_the_etcd_before_the_job() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1"), ("job.rdzv_backend", "etcd")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    for doc in &docs {
        let name = doc["metadata"]["name"].as_str().unwrap();
        let path = match doc["kind"].as_str().unwrap() {
            "Secret" => format!("/api/v1/namespaces/default/secrets/{name}"),
            "Service" => format!("/api/v1/namespaces/default/services/{name}"),
            "Deployment" => format!("/apis/apps/v1/namespaces/default/deployments/{name}"),
            "Job" => JOB.to_string(),
            k => panic!("{k}"),
        };
        api.on(Method::PATCH, &path, vec![ok(doc.clone())]);
    }
    let applied = api.kube().launch("cifar10", &docs).await.unwrap();
    let names: Vec<String> = applied
        .iter()
        .map(|a| format!("{} {}", a.kind, a.name))
        .collect();
    assert_eq!(
        names,
        [
            "Secret cifar10-token",
            "Service cifar10-etcd",
            "Deployment cifar10-etcd",
            "Service cifar10",
            "Job cifar10"
        ]
    );
}

fn etcd_pod(phase: &str, status: Value) -> Value {
    let mut status = status;
    status["phase"] = json!(phase);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "cifar10-etcd-7d9f8-x2x4q",
            "namespace": "default",
            "uid": "uid-etcd",
            "labels": {
                "trainctl.dev/job": "cifar10",
                "trainctl.dev/component": "etcd",
                "app.kubernetes.io/managed-by": "trainctl",
            },
        },
        "spec": { "containers": [{ "name": "etcd" }], "nodeName": "ip-10-0-0-9" },
        "status": status,
    })
}

/// The etcd's pod is shown with the job's (a broken etcd is a root cause), but a running etcd
/// does not make a job whose workers wait for nodes look running, and its logs are not mixed
/// into the workers'.
#[tokio::test]
async fn status_shows_the_jobs_etcd_beside_its_pods() {
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 2 })));
    let pulling = json!({
        "containerStatuses": [{
            "name": "etcd", "ready": false, "restartCount": 0, "image": "etcd", "imageID": "",
            "state": { "waiting": { "reason": "ImagePullBackOff", "message": "Back-off pulling image \"quay.io/coreos/etcd:v3.5.17\"" } },
        }],
    });
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(0, "Pending", None, json!({})),
                etcd_pod("Pending", pulling),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(status.pods.len(), 1, "{status:?}");
    assert_eq!(status.companions.len(), 1, "{status:?}");
    let text = status.render();
    assert!(text.contains("cifar10-etcd-7d9f8-x2x4q"), "{text}");
    assert!(text.contains("ImagePullBackOff"), "{text}");

    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 1 })));
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(0, "Pending", None, json!({})),
                etcd_pod("Running", json!({})),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    assert_eq!(
        status.phase,
        Phase::Pending,
        "the etcd runs, no worker does"
    );
    // No worker has started: logs say so (the etcd's pod is not one of the job's).
    let e = api
        .kube()
        .logs("cifar10", false, &mut |_: &str| {})
        .await
        .unwrap_err();
    assert!(matches!(e, ApiError::NoLogsYet { .. }), "{e}");
    assert!(
        !api.requests().iter().any(|r| r.contains("cifar10-etcd")),
        "{:?}",
        api.requests()
    );
}

/// `job delete` takes the etcd and TensorBoard Deployments with the job.
#[tokio::test]
async fn delete_removes_the_etcd_and_tensorboard_deployments() {
    let api = MockApi::default();
    let named = |kind: &str, name: &str| json!({ "apiVersion": "v1", "kind": kind, "metadata": { "name": name, "namespace": "default" } });
    api.get(
        "/apis/batch/v1/namespaces/default/jobs",
        list("JobList", vec![named("Job", "cifar10")]),
    );
    api.get(
        "/apis/apps/v1/namespaces/default/deployments",
        list(
            "DeploymentList",
            vec![
                named("Deployment", "cifar10-etcd"),
                named("Deployment", "cifar10-tensorboard"),
            ],
        ),
    );
    api.get(
        "/api/v1/namespaces/default/services",
        list("ServiceList", vec![named("Service", "cifar10-etcd")]),
    );
    for path in [
        JOB,
        "/apis/apps/v1/namespaces/default/deployments/cifar10-tensorboard",
        "/api/v1/namespaces/default/services/cifar10-etcd",
    ] {
        api.on(Method::DELETE, path, vec![deleted()]);
    }
    // The etcd Deployment is owned by the job: the garbage collector removed it with the job
    // between the listing and its turn. It went with the job, and is reported.
    api.on(
        Method::DELETE,
        "/apis/apps/v1/namespaces/default/deployments/cifar10-etcd",
        vec![not_found("deployments.apps \"cifar10-etcd\"")],
    );
    empty_lists(&api);
    let deleted = api.kube().delete("cifar10").await.unwrap();
    let names: Vec<String> = deleted
        .iter()
        .map(|d| format!("{} {}", d.kind, d.name))
        .collect();
    assert_eq!(
        names,
        [
            "Job cifar10",
            "Deployment cifar10-etcd",
            "Deployment cifar10-tensorboard",
            "Service cifar10-etcd"
        ]
    );
}

/// `trainctl tensorboard` applies a Service and a Deployment; `--delete` lists TensorBoard's
/// objects by its component label only.
#[tokio::test]
async fn tensorboard_is_applied_and_deleted_by_its_component() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = manifests::tensorboard(&p);
    api.on(
        Method::PATCH,
        "/api/v1/namespaces/default/services/cifar10-tensorboard",
        vec![ok(docs[0].clone())],
    );
    api.on(
        Method::PATCH,
        "/apis/apps/v1/namespaces/default/deployments/cifar10-tensorboard",
        vec![ok(docs[1].clone())],
    );
    let applied = api.kube().apply(&docs).await.unwrap();
    assert_eq!(applied.len(), 2);
    let named = |kind: &str, name: &str| json!({ "apiVersion": "v1", "kind": kind, "metadata": { "name": name, "namespace": "default" } });
    api.get(
        "/apis/apps/v1/namespaces/default/deployments",
        list(
            "DeploymentList",
            vec![named("Deployment", "cifar10-tensorboard")],
        ),
    );
    api.on(
        Method::DELETE,
        "/apis/apps/v1/namespaces/default/deployments/cifar10-tensorboard",
        vec![deleted()],
    );
    empty_lists(&api);
    let deleted = api
        .kube()
        .delete_matching(&manifests::component_selector("cifar10", "tensorboard"))
        .await
        .unwrap();
    assert_eq!(deleted.len(), 1);
    assert!(
        api.requests()
            .iter()
            .any(|r| r.contains("trainctl.dev%2Fcomponent%3Dtensorboard")),
        "{:?}",
        api.requests()
    );
}

/// `storage` with a volume already bound to a claim in another namespace: a new claim here
/// could never bind it. Said before anything is written.
#[tokio::test]
async fn storage_bound_in_another_namespace_is_refused() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = manifests::storage(&p).unwrap();
    api.get(
        "/api/v1/persistentvolumes/trainctl-data",
        json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": { "name": "trainctl-data" },
            "spec": { "claimRef": { "namespace": "ml", "name": "trainctl-data" } },
        }),
    );
    let e = api.kube().apply_storage(&docs).await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(
            "PersistentVolume trainctl-data is bound to claim trainctl-data in namespace ml, so a \
             claim in namespace default could never bind it: use --namespace ml"
        ),
        "{text}"
    );
    assert!(!api.requests().iter().any(|r| r.starts_with("PATCH")));
}

/// `storage --efs` after `--host-path`: the volume's source is immutable. Every object is tried
/// with a server-side dry run first, so the refusal leaves no stray StorageClass, and the error
/// says what to delete.
#[tokio::test]
async fn a_storage_change_that_cannot_apply_writes_nothing() {
    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = manifests::storage(&p).unwrap();
    let class = format!(
        "/apis/storage.k8s.io/v1/storageclasses/{}",
        docs[0]["metadata"]["name"].as_str().unwrap()
    );
    api.on(Method::PATCH, &class, vec![ok(docs[0].clone())]);
    api.on(
        Method::PATCH,
        "/api/v1/persistentvolumes/trainctl-data",
        vec![status(
            422,
            "Invalid",
            "PersistentVolume \"trainctl-data\" is invalid: spec.persistentvolumesource: Forbidden: spec.persistentvolumesource is immutable after creation",
        )],
    );
    let e = api.kube().apply_storage(&docs).await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("PersistentVolume trainctl-data exists with other settings that cannot be changed in place"),
        "{text}"
    );
    assert!(
        text.contains(
            "kubectl delete pvc trainctl-data -n default && kubectl delete pv trainctl-data"
        ),
        "{text}"
    );
    let patches: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("PATCH"))
        .collect();
    assert_eq!(patches.len(), 2, "{patches:?}");
    assert!(
        patches.iter().all(|r| r.contains("dryRun=All")),
        "{patches:?}"
    );
}

/// `KUBECONFIG=/missing:/real`: the missing file is skipped, as kubectl skips it. A port where
/// nothing listens reads as that, with the whole chain of causes, not a bare "client error
/// (Connect)".
#[tokio::test]
async fn kubeconfig_skips_missing_files_and_a_closed_port_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let real = dir.path().join("config");
    std::fs::write(
        &real,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: \
             http://127.0.0.1:{port}\ncontexts:\n- name: x\n  context:\n    cluster: c\n    \
             user: u\ncurrent-context: x\nusers:\n- name: u\n  user:\n    token: abc\n"
        ),
    )
    .unwrap();
    let value = format!(
        "{}:{}",
        dir.path().join("missing").display(),
        real.display()
    );
    let kube = Kube::connect("default", Some(std::ffi::OsStr::new(&value)))
        .await
        .unwrap();
    let e = kube.status("cifar10").await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, ApiError::Unreachable(_)), "{text}");
    assert!(
        text.contains("nothing listens at the API server's address"),
        "{text}"
    );
    assert!(text.contains("Connection refused"), "{text}");
}

/// 401 says the credentials are refused and how to refresh them; a 403 on a cluster-scoped
/// object names the cluster scope, not a namespace; a 404 for the namespace itself names it.
#[tokio::test]
async fn unauthorized_forbidden_and_missing_namespace_say_what_to_do() {
    let api = MockApi::default();
    api.on(
        Method::GET,
        JOB,
        vec![status(401, "Unauthorized", "Unauthorized")],
    );
    let e = api.kube().status("cifar10").await.unwrap_err().to_string();
    assert!(
        e.contains("the cluster does not accept your credentials")
            && e.contains("aws eks update-kubeconfig"),
        "{e}"
    );

    let api = MockApi::default();
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = manifests::storage(&p).unwrap();
    api.on(
        Method::GET,
        "/api/v1/persistentvolumes/trainctl-data",
        vec![status(
            403,
            "Forbidden",
            "persistentvolumes \"trainctl-data\" is forbidden: User \"dev\" cannot get resource \"persistentvolumes\" in API group \"\" at the cluster scope",
        )],
    );
    let e = api
        .kube()
        .apply_storage(&docs)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.ends_with("needs RBAC permission for this at the cluster scope (a ClusterRole)"),
        "{e}"
    );
    assert!(!e.contains("in namespace"), "{e}");

    let api = MockApi::default();
    let secret = launchers::training_job(&p, launchers::Token::Value("T")).remove(0);
    api.on(
        Method::PATCH,
        "/api/v1/namespaces/default/secrets/cifar10-token",
        vec![(
            StatusCode::NOT_FOUND,
            json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "namespaces \"default\" not found", "reason": "NotFound",
                "details": { "name": "default", "kind": "namespaces" }, "code": 404,
            })
            .to_string(),
        )],
    );
    let e = api.kube().apply(&[secret]).await.unwrap_err();
    assert!(matches!(e, ApiError::NoNamespace { .. }), "{e}");
}

/// The cpu preset's pods on a cluster that is not EKS (kind, k3s): no node has the instance-type
/// label they select, nor 13 CPUs. Said up front, naming the selector, the nodes and what to
/// pass; nothing is said where a node fits.
#[tokio::test]
async fn no_node_fits_names_the_selector_the_nodes_and_what_to_pass() {
    let kind_node = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": "kind-control-plane", "labels": { "kubernetes.io/hostname": "kind-control-plane" } },
        "status": { "allocatable": { "cpu": "2", "memory": "8029876Ki" } },
    });
    let api = MockApi::default();
    api.get("/api/v1/nodes", list("NodeList", vec![kind_node]));
    let kube = api.kube();
    let selector = (
        "node.kubernetes.io/instance-type".to_string(),
        "c5.4xlarge".to_string(),
    );
    let why = kube
        .no_node_fits(Some(&selector), "13", "25Gi")
        .await
        .expect("nothing fits");
    assert!(
        why.starts_with(
            "no node has the label node.kubernetes.io/instance-type=c5.4xlarge that the pods select \
             (nodes: kind-control-plane (no instance type, 2 CPU, 8029876Ki memory)); pass \
             --node-selector none"
        ),
        "{why}"
    );
    let why = kube
        .no_node_fits(None, "13", "25Gi")
        .await
        .expect("too big");
    assert!(
        why.starts_with("no node can give a pod 13 CPU and 25Gi memory")
            && why.contains("--cpu and --memory"),
        "{why}"
    );
    assert_eq!(kube.no_node_fits(None, "500m", "1Gi").await, None);
}

/// A kubeconfig whose CA is another cluster's: the TLS handshake fails, and the error says the
/// server's certificate is not one the kubeconfig trusts (a closed port says something else,
/// above), with rustls's own reason.
#[tokio::test]
async fn a_server_certificate_from_another_ca_says_so() {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let cert = CertificateDer::from_pem_file(fixtures.join("server.crt")).unwrap();
    let key = PrivateKeyDer::from_pem_file(fixtures.join("server.key")).unwrap();
    let config = tokio_rustls::rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        // Handshakes only: the client gives up in them.
        while let Ok((socket, _)) = listener.accept().await {
            let _ = acceptor.accept(socket).await;
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: \
             https://127.0.0.1:{port}\n    certificate-authority: {}\ncontexts:\n- name: x\n  \
             context:\n    cluster: c\n    user: u\ncurrent-context: x\nusers:\n- name: u\n  \
             user:\n    token: abc\n",
            fixtures.join("other-ca.crt").display()
        ),
    )
    .unwrap();
    let kube = Kube::connect("default", Some(kubeconfig.as_os_str()))
        .await
        .unwrap();
    let e = kube.status("cifar10").await.unwrap_err();
    server.abort();
    let text = e.to_string();
    assert!(matches!(e, ApiError::Unreachable(_)), "{text}");
    assert!(
        text.contains("the server's TLS certificate is not one your kubeconfig trusts"),
        "{text}"
    );
    assert!(text.contains("UnknownIssuer"), "{text}");
}

/// The Scale the API server answers for a Deployment's scale subresource.
fn scale(name: &str, replicas: i32, running: i32) -> Value {
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "replicas": replicas },
        "status": { "replicas": running, "selector": "trainctl.dev/job=cifar10,trainctl.dev/component=etcd" },
    })
}

fn etcd_deployment(replicas: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {
            "name": "cifar10-etcd", "namespace": "default",
            "labels": { "trainctl.dev/job": "cifar10", "trainctl.dev/component": "etcd" },
        },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "trainctl.dev/job": "cifar10", "trainctl.dev/component": "etcd" } },
            "template": { "spec": { "containers": [] } },
        },
    })
}

/// Once the job has finished nothing rendezvouses through its etcd: the command that sees it
/// finished scales the etcd's Deployment (found by its labels) to zero, leaving the Deployment
/// and its Service for `job delete` and the TTL. While the job runs, or once the etcd has no
/// pod left, nothing is asked or changed.
#[tokio::test]
async fn a_finished_jobs_etcd_is_scaled_to_zero() {
    const DEPLOYMENTS: &str = "/apis/apps/v1/namespaces/default/deployments";
    const SCALE: &str = "/apis/apps/v1/namespaces/default/deployments/cifar10-etcd/scale";
    let done =
        job(json!({ "succeeded": 2, "conditions": [{ "type": "Complete", "status": "True" }] }));
    let finished_pod = |i| pod(i, "Succeeded", Some("n1"), json!({}));

    let api = MockApi::default();
    api.get(JOB, done.clone());
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                finished_pod(0),
                finished_pod(1),
                etcd_pod("Running", json!({})),
            ],
        ),
    );
    api.get(
        DEPLOYMENTS,
        list("DeploymentList", vec![etcd_deployment(1)]),
    );
    api.on(Method::PATCH, SCALE, vec![ok(scale("cifar10-etcd", 0, 1))]);
    let kube = api.kube();
    let status = kube.status("cifar10").await.unwrap();
    let stopped = kube.stop_etcd_if_finished(&status).await.unwrap();
    let names: Vec<String> = stopped
        .iter()
        .map(|d| format!("{} {}", d.kind, d.name))
        .collect();
    assert_eq!(names, ["Deployment cifar10-etcd"]);
    let requests = api.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with(&format!("GET {DEPLOYMENTS}?"))
                && r.contains(
                    "labelSelector=trainctl.dev%2Fjob%3Dcifar10%2Ctrainctl.dev%2Fcomponent%3Detcd"
                )),
        "{requests:#?}"
    );
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with(&format!("PATCH {SCALE}"))),
        "{requests:#?}"
    );
    assert!(
        !requests.iter().any(|r| r.starts_with("DELETE")),
        "the Deployment stays: {requests:#?}"
    );
    let bodies = api.bodies.lock().unwrap().clone();
    assert_eq!(bodies, [json!({ "spec": { "replicas": 0 } })]);

    // A running job keeps its etcd: nothing is asked.
    let api = MockApi::default();
    api.get(JOB, job(json!({ "active": 2 })));
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                pod(0, "Running", Some("n1"), json!({})),
                etcd_pod("Running", json!({})),
            ],
        ),
    );
    let kube = api.kube();
    let status = kube.status("cifar10").await.unwrap();
    assert!(
        kube.stop_etcd_if_finished(&status)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        !api.requests().iter().any(|r| r.contains("deployments")),
        "{:?}",
        api.requests()
    );

    // Stopped already (no etcd pod): nothing is asked either.
    let api = MockApi::default();
    api.get(JOB, done);
    api.get(PODS, list("PodList", vec![finished_pod(0)]));
    let kube = api.kube();
    let status = kube.status("cifar10").await.unwrap();
    assert!(
        kube.stop_etcd_if_finished(&status)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        !api.requests().iter().any(|r| r.contains("deployments")),
        "{:?}",
        api.requests()
    );
}

/// A running Indexed Job of `completions` pods launched with `--nnodes` `bounds`.
fn elastic_job(completions: u32, bounds: Option<&str>) -> Value {
    let mut j = job(json!({ "active": completions }));
    j["spec"]["completions"] = json!(completions);
    j["spec"]["parallelism"] = json!(completions);
    if let Some(bounds) = bounds {
        j["metadata"]["annotations"] = json!({
            "trainctl.dev/nnodes": bounds,
            "trainctl.dev/trainer": "built-in",
        });
    }
    j
}

#[tokio::test]
async fn scale_patches_completions_and_parallelism_within_the_jobs_bounds() {
    use deploy::kube_api::ScaleError;
    let api = MockApi::default();
    api.get(JOB, elastic_job(4, Some("2:4")));
    api.on(Method::PATCH, JOB, vec![ok(elastic_job(2, Some("2:4")))]);
    let kube = api.kube();
    let scaled = kube.scale("cifar10", 2).await.unwrap();
    assert_eq!((scaled.from, scaled.to, scaled.launcher), (4, 2, "indexed"));
    assert!(!scaled.program);
    let bodies = api.bodies.lock().unwrap().clone();
    assert_eq!(
        bodies,
        vec![json!({ "spec": { "completions": 2, "parallelism": 2 } })],
        "one merge patch, both fields together (the API refuses one alone)"
    );
    assert!(
        api.requests()
            .iter()
            .any(|r| r.starts_with("PATCH ") && r.contains("/jobs/cifar10")),
        "{:?}",
        api.requests()
    );

    for asked in [1, 5] {
        let err = kube.scale("cifar10", asked).await.unwrap_err();
        assert!(err.is_usage(), "{err}");
        let said = err.to_string();
        assert!(
            said.contains("--nnodes 2:4") && said.contains(&format!("not {asked}")),
            "{said}"
        );
    }
    assert_eq!(
        api.bodies.lock().unwrap().len(),
        1,
        "a refused size patches nothing"
    );

    // A job launched before `job scale` (no bounds on it): refused, saying what to do.
    let api = MockApi::default();
    api.get(JOB, elastic_job(3, None));
    let err = api.kube().scale("cifar10", 2).await.unwrap_err();
    assert!(
        matches!(err, ScaleError::Cannot { .. }) && err.to_string().contains("relaunch"),
        "{err}"
    );
}

#[tokio::test]
async fn scale_of_a_finished_job_or_a_trainjob_is_refused_saying_why() {
    let api = MockApi::default();
    let mut done = elastic_job(2, Some("1:4"));
    done["status"] = json!({
        "conditions": [{ "type": "Complete", "status": "True" }],
    });
    api.get(JOB, done);
    let err = api.kube().scale("cifar10", 3).await.unwrap_err();
    assert!(err.to_string().contains("succeeded already"), "{err}");

    let api = MockApi::default();
    api.get(
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs/cifar10",
        json!({
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": { "name": "cifar10", "namespace": "default" },
            "spec": {},
        }),
    );
    let err = api.kube().scale("cifar10", 3).await.unwrap_err();
    let said = err.to_string();
    assert!(
        said.contains("only while") && said.contains("--launcher indexed"),
        "{said}"
    );
    assert!(api.bodies.lock().unwrap().is_empty());
}

/// Issue 57's and issue 60's (item 5) status lines: who trains, waits (and why) and leaves,
/// and an index whose replacement the Job controller holds back.
#[tokio::test]
async fn status_says_which_pods_train_wait_and_leave() {
    let api = MockApi::default();
    api.get(JOB, elastic_job(3, Some("2:4")));
    let mut leaving = pod(
        2,
        "Running",
        Some("n1"),
        json!({ "containerStatuses": [running_container(0)] }),
    );
    leaving["metadata"]["deletionTimestamp"] = json!("2026-11-28T10:00:00Z");
    let unschedulable = json!({
        "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 Insufficient cpu.",
        }],
    });
    let running = |i| {
        pod(
            i,
            "Running",
            Some("n1"),
            json!({ "containerStatuses": [running_container(0)] }),
        )
    };
    api.get(
        PODS,
        list(
            "PodList",
            vec![
                running(0),
                running(1),
                leaving,
                pod(3, "Pending", None, unschedulable),
            ],
        ),
    );
    let status = api.kube().status("cifar10").await.unwrap();
    let text = status.render();
    assert!(
        text.contains("pods: 2 running, 1 pending, 1 leaving"),
        "{text}"
    );
    let row = text.lines().find(|l| l.contains("cifar10-2-")).unwrap();
    assert!(
        row.contains("Leaving") && row.contains("leaves the job"),
        "{row}"
    );
    let row = text.lines().find(|l| l.contains("cifar10-3-")).unwrap();
    assert!(
        row.contains("Pending") && row.contains("Insufficient cpu"),
        "{row}"
    );
    // Index 2's pod leaves (deleted by hand): its replacement is on its way, after a backoff.
    assert!(
        text.contains("index 2 has no pod now: the Job controller creates its replacement"),
        "{text}"
    );
    assert!(!text.contains("index 0 has no pod"), "{text}");
}

/// Issue 60, items 1 to 3: a job deleted while followed. Its pod's stream is read to its end
/// (the pod's last lines, its stop's too), the container that simply exited is not called an
/// interrupted stream (its status lagged a moment behind), the kubelet's word about a log
/// already gone is not shown as the pod's output, and the follow ends saying the job was
/// deleted.
#[tokio::test]
async fn follow_of_a_deleted_job_reads_its_pods_to_the_end_and_says_so() {
    let api = MockApi::default();
    const POD: &str = "/api/v1/namespaces/default/pods/cifar10-0-abcde";
    const LOG: &str = "/api/v1/namespaces/default/pods/cifar10-0-abcde/log";
    let training = pod(
        0,
        "Running",
        Some("n1"),
        json!({ "containerStatuses": [running_container(0)] }),
    );
    // The Job is gone once the pod's stream has been opened.
    api.on_after(
        Method::GET,
        JOB,
        vec![ok(job(json!({ "active": 1 })))],
        (LOG, 1),
        vec![not_found("jobs \"cifar10\" not found")],
    );
    api.get(PODS, list("PodList", vec![training.clone()]));
    let mut stopped = training.clone();
    stopped["status"]["phase"] = json!("Failed");
    stopped["status"]["containerStatuses"][0]["state"] =
        json!({ "terminated": { "exitCode": 143, "reason": "Error" } });
    // Still said to run just after its stream ended; stopped a moment later.
    api.on(Method::GET, POD, vec![ok(&training), ok(&stopped)]);
    api.on(
        Method::GET,
        LOG,
        vec![(
            StatusCode::OK,
            "2026-11-21T10:00:01.000000000Z step 1\n\
             2026-11-21T10:00:02.000000000Z trainctl run: node leaves (SIGTERM)\n\
             unable to retrieve container logs for containerd://4f2a\n"
                .into(),
        )],
    );
    let mut lines = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        api.kube()
            .with_poll(Duration::from_millis(50))
            .logs("cifar10", true, &mut |l: &str| lines.push(l.to_string())),
    )
    .await
    .expect("follow ends once the deleted job's pods have")
    .unwrap();
    let all = lines.join("\n");
    assert!(
        all.contains("pod 0] trainctl run: node leaves (SIGTERM)"),
        "{all}"
    );
    assert!(
        all.contains("pod 0] (not from the pod: unable to retrieve container logs"),
        "{all}"
    );
    assert!(!all.contains("interrupted"), "{all}");
    assert!(
        lines.last().is_some_and(|l| l.starts_with(
            "(job cifar10 was deleted: its pods stopped, and their last lines are above"
        )),
        "{all}"
    );
}
