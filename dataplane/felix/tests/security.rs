//! Authentication and authorization end to end (docs/security.md), with the real binary over
//! QUIC on loopback: mutual TLS (a client certificate names the principal; none, or one from
//! another CA, is refused), bearer tokens made by `felix token add` (wrong and malformed ones
//! refused; a SIGHUP after `felix token revoke` refuses the token and closes its connection
//! while another principal's connection keeps working), rules of every kind, the filtered
//! list, describe and shard map, the start-up checks, and the metrics of each refusal.

mod support;

use std::path::{Path, PathBuf};

use felix_client::{Client, ClientConfig, ClientError, ClientIdentity, ErrorCode, StreamKind};
use felix_client::{ShardSelection, StartPosition, record};
use futures::StreamExt as _;
use support::{BrokerProcess, DEADLINE, felix, labelled_value, within};

/// A certificate authority of the test: signs client certificates.
struct Pki {
    dir: tempfile::TempDir,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_path: PathBuf,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = tempfile::tempdir().expect("temp dir");
        let key = rcgen::KeyPair::generate().expect("CA key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("CA certificate");
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, cert.pem()).expect("CA written");
        Pki {
            dir,
            issuer: rcgen::Issuer::new(params, key),
            ca_path,
        }
    }

    /// A client certificate for `common_name`, signed by this CA: (cert path, key path).
    fn client(&self, common_name: &str) -> ClientIdentity {
        let key = rcgen::KeyPair::generate().expect("client key");
        let mut params =
            rcgen::CertificateParams::new(vec![format!("{common_name}.example")]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let cert_path = self.dir.path().join(format!("{common_name}.pem"));
        let key_path = self.dir.path().join(format!("{common_name}.key"));
        std::fs::write(&cert_path, cert.pem()).expect("cert written");
        std::fs::write(&key_path, key.serialize_pem()).expect("key written");
        ClientIdentity {
            cert: cert_path,
            key: key_path,
        }
    }

    fn ca(&self) -> &str {
        self.ca_path.to_str().expect("a UTF-8 path")
    }
}

/// `felix token add PRINCIPAL` into `file`: the token it prints.
fn token_add(file: &Path, principal: &str) -> String {
    let output = felix()
        .args(["token", "add", principal, "--file"])
        .arg(file)
        .output()
        .expect("felix token add runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let token = String::from_utf8(output.stdout).expect("UTF-8");
    token.trim().to_owned()
}

/// One connection (no per-core connections), authenticated by `token` / `identity`.
fn config(
    broker: &BrokerProcess,
    token: Option<&str>,
    identity: Option<ClientIdentity>,
) -> ClientConfig {
    let mut config = broker.naive_client_config();
    config.token = token.map(str::to_owned);
    config.identity = identity;
    config
}

async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
    within(Client::connect(config)).await
}

fn code(result: Result<impl std::fmt::Debug, ClientError>) -> (Option<ErrorCode>, String) {
    match result {
        Ok(value) => panic!("expected a refusal, got {value:?}"),
        Err(error) => (error.code(), error.to_string()),
    }
}

fn counter(broker: &BrokerProcess, name_and_labels: &str) -> f64 {
    labelled_value(&broker.metrics(), name_and_labels).unwrap_or(0.0)
}

// Proves FELIX_CLIENT_CA + FELIX_AUTH=required: a certificate from that CA is accepted and its
// Common Name is the principal the rules see; no certificate gets Unauthenticated; a
// certificate of another CA fails the TLS handshake; each is counted.
#[tokio::test]
async fn mutual_tls_names_the_principal_and_refuses_others() {
    let pki = Pki::new("felix-test-ca");
    let stranger = Pki::new("another-ca");
    let broker = BrokerProcess::start(&[
        ("FELIX_CLIENT_CA", pki.ca()),
        ("FELIX_AUTH", "required"),
        ("FELIX_RULES", "bob admin,publish,subscribe bob.*"),
    ]);
    let bob = connect(config(&broker, None, Some(pki.client("bob"))))
        .await
        .expect("bob's certificate is accepted");
    within(bob.create_stream("bob.orders", 2, StreamKind::InMemory))
        .await
        .expect("bob administers bob.*");
    let acks = within(bob.publish("bob.orders", &[record("k", "v")]))
        .await
        .expect("bob publishes to bob.*");
    assert_eq!(acks.len(), 1);
    let (denied, message) =
        code(within(bob.create_stream("alice.orders", 1, StreamKind::InMemory)).await);
    assert_eq!(denied, Some(ErrorCode::PermissionDenied));
    assert!(
        message.contains("bob may not create stream \"alice.orders\""),
        "{message}"
    );
    let (refused, message) = code(connect(config(&broker, None, None)).await);
    assert_eq!(refused, Some(ErrorCode::Unauthenticated), "{message}");
    let wrong_ca = connect(config(&broker, None, Some(stranger.client("bob")))).await;
    let (none, message) = code(wrong_ca);
    assert_eq!(none, None, "refused by TLS, before any frame: {message}");
    // bob's connection is untouched.
    within(bob.publish("bob.orders", &[record("k", "again")]))
        .await
        .expect("still served");
    assert_eq!(
        counter(&broker, "felix_auth_refused_total{reason=\"missing\"}"),
        1.0
    );
    assert!(
        counter(
            &broker,
            "felix_permission_denied_total{operation=\"create\"}"
        ) >= 1.0
    );
    bob.close().await;
}

// Proves bearer tokens: `felix token add` makes tokens the broker accepts as their principal;
// a wrong secret and a malformed token are refused; after `felix token revoke` and SIGHUP the
// revoked token is refused and its open connection closed, while another principal's open
// connection keeps publishing; each refusal is counted by reason.
#[tokio::test]
async fn tokens_authenticate_and_sighup_revokes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = dir.path().join("tokens");
    let alice = token_add(&tokens, "alice");
    let carol = token_add(&tokens, "carol");
    assert!(alice.starts_with("felix_") && alice != carol);
    let tokens_path = tokens.to_str().expect("UTF-8 path");
    let broker = BrokerProcess::start(&[
        ("FELIX_TOKENS_FILE", tokens_path),
        ("FELIX_AUTH", "required"),
        ("FELIX_RULES", "alice admin,publish *; carol publish *"),
    ]);
    let alice_client = connect(config(&broker, Some(&alice), None))
        .await
        .expect("alice's token is accepted");
    within(alice_client.create_stream("shared", 2, StreamKind::InMemory))
        .await
        .expect("alice creates");
    let carol_client = connect(config(&broker, Some(&carol), None))
        .await
        .expect("carol's token is accepted");
    let (denied, message) =
        code(within(carol_client.create_stream("mine", 1, StreamKind::InMemory)).await);
    assert_eq!(
        denied,
        Some(ErrorCode::PermissionDenied),
        "carol is carol: {message}"
    );
    // The same id with another secret; and a token of the wrong shape.
    let mut wrong = alice.clone();
    let last = wrong.pop().expect("a non-empty token");
    wrong.push(if last == '0' { '1' } else { '0' });
    let (refused, message) = code(connect(config(&broker, Some(&wrong), None)).await);
    assert_eq!(refused, Some(ErrorCode::Unauthenticated));
    assert!(message.contains("wrong token"), "{message}");
    let (refused, message) = code(connect(config(&broker, Some("not-a-token"), None)).await);
    assert_eq!(refused, Some(ErrorCode::Unauthenticated));
    assert!(message.contains("malformed"), "{message}");
    // The CLI takes the token from the environment.
    let listed = broker
        .cli()
        .args(["stream", "list"])
        .env("FELIX_TOKEN", &carol)
        .output()
        .expect("felix stream list runs");
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    // Revoke alice, reload.
    let revoked = felix()
        .args(["token", "revoke", "alice", "--file", tokens_path])
        .output()
        .expect("felix token revoke runs");
    assert!(
        revoked.status.success(),
        "{}",
        String::from_utf8_lossy(&revoked.stderr)
    );
    broker.signal("HUP");
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        let attempt = connect(config(&broker, Some(&alice), None)).await;
        match attempt {
            Err(error) if error.code() == Some(ErrorCode::Unauthenticated) => {
                assert!(error.to_string().contains("unknown token"), "{error}");
                break;
            }
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "still accepted: {other:?}"
                );
                if let Ok(client) = other {
                    client.close().await;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
    // alice's open connection is closed by the reload.
    let deadline = std::time::Instant::now() + DEADLINE;
    while within(alice_client.publish("shared", &[record("k", "v")]))
        .await
        .is_ok()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "alice's connection stayed open"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // carol's open connection keeps working.
    let acks = within(carol_client.publish("shared", &[record("k", "carol")]))
        .await
        .expect("carol is still served");
    assert_eq!(acks.len(), 1);
    let refused = |reason: &str| {
        counter(
            &broker,
            &format!("felix_auth_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(refused("wrong"), 1.0);
    assert_eq!(refused("malformed"), 1.0);
    assert!(refused("unknown") >= 1.0);
    assert_eq!(refused("revoked"), 1.0);
    carol_client.close().await;
}

// Proves rules of each kind with wildcards and the `*` principal (anonymous included, in open
// mode): publish, subscribe, create, delete and describe are allowed exactly where a rule
// grants them; list, describe and the shard map show only streams the principal may see.
#[tokio::test]
async fn rules_allow_and_deny_each_operation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = dir.path().join("tokens");
    let ops = token_add(&tokens, "ops");
    let alice = token_add(&tokens, "alice");
    let broker = BrokerProcess::start(&[
        ("FELIX_TOKENS_FILE", tokens.to_str().expect("UTF-8 path")),
        (
            "FELIX_RULES",
            "ops admin *; alice publish,subscribe orders.*; * subscribe public.*",
        ),
    ]);
    let ops = connect(config(&broker, Some(&ops), None))
        .await
        .expect("ops");
    for name in ["orders.eu", "orders.us", "public.news", "payroll"] {
        within(ops.create_stream(name, 2, StreamKind::InMemory))
            .await
            .expect("ops creates anything");
    }
    let alice = connect(config(&broker, Some(&alice), None))
        .await
        .expect("alice");
    let anonymous = connect(config(&broker, None, None))
        .await
        .expect("anonymous");
    // Publish and subscribe where granted.
    let mut subscription =
        within(alice.subscribe("orders.us", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("alice subscribes to orders.*");
    within(alice.publish("orders.us", &[record("k", "hello")]))
        .await
        .expect("alice publishes to orders.*");
    let delivered = within(subscription.next())
        .await
        .expect("a record")
        .expect("delivered");
    assert_eq!(&delivered.payload[..], b"hello");
    let _news =
        within(anonymous.subscribe("public.news", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("anyone subscribes to public.*");
    let (ops_publish, _) = code(within(ops.publish("public.news", &[record("k", "v")])).await);
    assert_eq!(
        ops_publish,
        Some(ErrorCode::PermissionDenied),
        "admin is not publish"
    );
    // Refused where not granted, with the operation and stream named.
    let denials = [
        (
            code(within(alice.publish("payroll", &[record("k", "v")])).await),
            "alice may not publish stream \"payroll\"",
        ),
        (
            code(
                within(alice.subscribe("payroll", ShardSelection::All, StartPosition::Latest))
                    .await,
            ),
            "alice may not subscribe stream \"payroll\"",
        ),
        (
            code(within(alice.create_stream("orders.jp", 1, StreamKind::InMemory)).await),
            "alice may not create stream \"orders.jp\"",
        ),
        (
            code(within(alice.delete_stream("orders.eu")).await),
            "alice may not delete stream \"orders.eu\"",
        ),
        (
            code(within(alice.describe_stream("payroll")).await),
            "alice may not describe stream \"payroll\"",
        ),
        (
            code(within(alice.describe_stream("no-such-stream")).await),
            "alice may not describe stream \"no-such-stream\"",
        ),
        (
            code(within(anonymous.publish("public.news", &[record("k", "v")])).await),
            "anonymous may not publish stream \"public.news\"",
        ),
    ];
    for ((code, message), expected) in denials {
        assert_eq!(code, Some(ErrorCode::PermissionDenied), "{message}");
        assert!(message.contains(expected), "{message} lacks {expected}");
    }
    within(alice.describe_stream("orders.eu"))
        .await
        .expect("alice describes orders.*");
    // What each principal sees.
    let listed: Vec<String> = within(alice.list_streams())
        .await
        .expect("listed")
        .into_iter()
        .map(|summary| summary.name)
        .collect();
    assert_eq!(listed, ["orders.eu", "orders.us", "public.news"]);
    let listed: Vec<String> = within(anonymous.list_streams())
        .await
        .expect("listed")
        .into_iter()
        .map(|summary| summary.name)
        .collect();
    assert_eq!(listed, ["public.news"]);
    // A connection made now gets a shard map of what it may see only.
    let late = connect(config(&broker, None, None))
        .await
        .expect("anonymous again");
    let routes: Vec<&str> = late
        .hello()
        .shard_map
        .iter()
        .map(|route| route.name.as_str())
        .collect();
    assert_eq!(routes, ["public.news"]);
    assert!(
        counter(
            &broker,
            "felix_permission_denied_total{operation=\"publish\"}"
        ) >= 3.0
    );
    assert!(
        counter(
            &broker,
            "felix_permission_denied_total{operation=\"describe\"}"
        ) >= 2.0
    );
}

/// `felix broker` with `env` that must refuse to start: its stderr.
fn refused_start(env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = felix()
        .arg("broker")
        .env("FELIX_DATA_DIR", dir.path())
        .env("FELIX_BIND", "127.0.0.1:0")
        .env("FELIX_METRICS_BIND", "127.0.0.1:0")
        .envs(env.iter().copied())
        .output()
        .expect("felix broker runs");
    assert!(!output.status.success(), "{output:?}");
    assert!(output.stdout.is_empty(), "nothing announced: {output:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

// Proves the development mode says it is open (start-up log and `felix config`), and that
// start-up stops naming the variable for a rule syntax error, a missing tokens file, and
// FELIX_AUTH=required with no way to authenticate.
#[test]
fn open_mode_is_announced_and_bad_security_settings_stop_start_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = felix()
        .arg("config")
        .env("FELIX_DATA_DIR", dir.path())
        .output()
        .expect("felix config runs");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.lines().any(|line| line.starts_with("auth: off")
            && line.contains("any client that reaches the broker may")),
        "{text}"
    );
    let broker = BrokerProcess::start(&[]);
    let open_lines = || {
        broker
            .stderr_text()
            .lines()
            .filter(|line| line.contains("auth: off"))
            .count()
    };
    // stderr is collected by a thread: wait for the line rather than race it.
    let deadline = std::time::Instant::now() + DEADLINE;
    while open_lines() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(
        open_lines(),
        1,
        "one start-up line says the broker is open:\n{}",
        broker.stderr_text()
    );
    let stderr = refused_start(&[("FELIX_RULES", "alice publsh orders.*")]);
    assert!(
        stderr.contains("FELIX_RULES") && stderr.contains("publsh"),
        "{stderr}"
    );
    let stderr = refused_start(&[("FELIX_TOKENS_FILE", "/nonexistent/felix-tokens")]);
    assert!(stderr.contains("FELIX_TOKENS_FILE"), "{stderr}");
    let stderr = refused_start(&[("FELIX_AUTH", "required")]);
    assert!(
        stderr.contains("FELIX_AUTH") && stderr.contains("FELIX_CLIENT_CA"),
        "{stderr}"
    );
    let stderr = refused_start(&[("FELIX_CLIENT_CA", "/nonexistent/ca.pem")]);
    assert!(stderr.contains("/nonexistent/ca.pem"), "{stderr}");
}
