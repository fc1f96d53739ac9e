//! TLS material: the configured certificate chain and key, or a self-signed development pair
//! generated once under the data directory. Runs on the caller's thread at start-up only.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use felix_tuning::Config;

use crate::BrokerError;

/// Subject alternative names of the development certificate: every loopback spelling a local
/// client may use as its TLS server name.
pub const DEV_CERT_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// Private keys are readable by their owner only.
const KEY_FILE_MODE: u32 = 0o600;

/// A PEM certificate chain and its PEM private key.
#[derive(Clone)]
pub struct CertificatePair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for CertificatePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("CertificatePair")
            .field("cert_pem_bytes", &self.cert_pem.len())
            .finish_non_exhaustive()
    }
}

/// Generates a self-signed certificate (ECDSA P-256) for `names`: each name that parses as an
/// IP address becomes an IP SAN, every other a DNS SAN.
pub fn generate_self_signed(names: &[String]) -> Result<CertificatePair, BrokerError> {
    if names.is_empty() {
        return Err(BrokerError::CertificateGeneration(
            "at least one name is needed".to_owned(),
        ));
    }
    let failed = |error: rcgen::Error| BrokerError::CertificateGeneration(error.to_string());
    let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(failed)?;
    // A subject of its own: a client that trusts several development certificates at once
    // (a cluster client trusting every member's) finds each one's issuer by subject, and
    // identical subjects would make it pick the wrong one.
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
        ^ u128::from(std::process::id()) << 64;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("Felix development certificate {unique:x}"),
    );
    let key = rcgen::KeyPair::generate().map_err(failed)?;
    let cert = params.self_signed(&key).map_err(failed)?;
    Ok(CertificatePair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Writes `pair` to `cert_path` and `key_path` (creating parent folders); the key file gets
/// mode 0600 before any key byte is written.
pub fn write_pair(
    pair: &CertificatePair,
    cert_path: &Path,
    key_path: &Path,
) -> Result<(), BrokerError> {
    for path in [cert_path, key_path] {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|source| BrokerError::Write {
                path: parent.to_path_buf(),
                source,
            })?;
        }
    }
    let key_error = |source| BrokerError::Write {
        path: key_path.to_path_buf(),
        source,
    };
    let mut key_file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(KEY_FILE_MODE)
        .open(key_path)
        .map_err(key_error)?;
    // `mode` only applies to new files: tighten an existing one too.
    key_file
        .set_permissions(fs::Permissions::from_mode(KEY_FILE_MODE))
        .map_err(key_error)?;
    key_file
        .write_all(pair.key_pem.as_bytes())
        .and_then(|()| key_file.sync_all())
        .map_err(key_error)?;
    fs::write(cert_path, pair.cert_pem.as_bytes()).map_err(|source| BrokerError::Write {
        path: cert_path.to_path_buf(),
        source,
    })?;
    Ok(())
}

fn read(path: &Path) -> Result<String, BrokerError> {
    fs::read_to_string(path).map_err(|source| BrokerError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// FELIX_CLIENT_CA, read once at start-up: the PEM CA certificate(s) client certificates must
/// chain to.
pub fn load_client_ca(config: &Config) -> Result<Option<String>, BrokerError> {
    let Some(path) = &config.client_ca else {
        return Ok(None);
    };
    let pem = read(path)?;
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(BrokerError::Setting {
            env: "FELIX_CLIENT_CA",
            value: path.display().to_string(),
            reason: "the file holds no PEM certificate".to_owned(),
        });
    }
    Ok(Some(pem))
}

/// Accepts any name in a client certificate: TLS has already verified its chain against
/// FELIX_CLIENT_CA, and the name becomes the principal the rules are written for, so there
/// is no expected name to compare it with (s2n-tls asks, for client certificates, whether the
/// name is acceptable).
struct AnyClientName;

impl s2n_quic::provider::tls::default::callbacks::VerifyHostNameCallback for AnyClientName {
    fn verify_host_name(&self, _host_name: &str) -> bool {
        true
    }
}

/// TLS extension type of ALPN (RFC 7301).
const EXTENSION_ALPN: u16 = 16;

/// Whether a ClientHello (the handshake message body, as s2n-tls gives it) offers ALPN
/// `protocol`; `None` when the message does not parse. Every length is checked against what
/// is present: the bytes come from an unauthenticated peer.
fn offers_alpn(hello: &[u8], protocol: &[u8]) -> Option<bool> {
    let mut rest = hello;
    let mut take = |len: usize| -> Option<&[u8]> {
        let (head, tail) = rest.split_at_checked(len)?;
        rest = tail;
        Some(head)
    };
    let u8_len = |bytes: &[u8]| usize::from(bytes[0]);
    let u16_len = |bytes: &[u8]| usize::from(u16::from_be_bytes([bytes[0], bytes[1]]));
    take(2 + 32)?; // legacy_version, random
    let session = u8_len(take(1)?);
    take(session)?;
    let suites = u16_len(take(2)?);
    take(suites)?;
    let compression = u8_len(take(1)?);
    take(compression)?;
    let extensions_len = u16_len(take(2)?);
    let mut extensions = take(extensions_len)?;
    while !extensions.is_empty() {
        let (header, tail) = extensions.split_at_checked(4)?;
        let kind = u16::from_be_bytes([header[0], header[1]]);
        let (body, tail) = tail.split_at_checked(u16_len(&header[2..]))?;
        extensions = tail;
        if kind != EXTENSION_ALPN {
            continue;
        }
        let (list_len, mut list) = body.split_at_checked(2)?;
        if u16_len(list_len) != list.len() {
            return None;
        }
        while !list.is_empty() {
            let (name_len, tail) = list.split_at_checked(1)?;
            let (name, tail) = tail.split_at_checked(usize::from(name_len[0]))?;
            if name == protocol {
                return Some(true);
            }
            list = tail;
        }
        return Some(false);
    }
    Some(false)
}

/// Refuses a ClientHello that does not offer ALPN `felix/1` at once. Without it s2n-tls
/// would go on without an application protocol and the client would wait for its handshake
/// timeout; QUIC requires ALPN (RFC 9001 section 8.1). The close carries the TLS alert
/// handshake_failure (QUIC 0x128): s2n-tls has no no_application_protocol alert for this
/// case, and s2n-quic's production close formatter reports every TLS alert as
/// handshake_failure anyway, as RFC 9001 section 4.8 allows.
struct RequireFelixAlpn;

/// Why a handshake was refused by [`RequireFelixAlpn`].
#[derive(Debug)]
struct NoFelixAlpn;

impl std::fmt::Display for NoFelixAlpn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the client does not offer ALPN felix/1 (no_application_protocol)"
        )
    }
}

impl std::error::Error for NoFelixAlpn {}

impl s2n_quic::provider::tls::default::callbacks::ClientHelloCallback for RequireFelixAlpn {
    fn on_client_hello(
        &self,
        connection: &mut s2n_quic::provider::tls::default::connection::Connection,
    ) -> Result<
        Option<
            std::pin::Pin<Box<dyn s2n_quic::provider::tls::default::callbacks::ConnectionFuture>>,
        >,
        s2n_quic::provider::tls::default::error::Error,
    > {
        let offered = connection
            .client_hello()
            .and_then(|hello| hello.raw_message())
            .ok()
            .and_then(|raw| offers_alpn(&raw, felix_wire::ALPN));
        if offered == Some(true) {
            return Ok(None);
        }
        tracing::debug!("TLS handshake refused: no ALPN felix/1");
        // Failing here, inside the connection's first datagram, makes s2n-quic drop the
        // connection without a word (it keeps no state for a connection whose first packet
        // failed). Failing on the next poll instead, once the connection exists, sends the
        // CONNECTION_CLOSE.
        Ok(Some(Box::pin(RefuseOnNextPoll { polled: false })))
    }
}

/// Fails the handshake on its second poll (see [`RequireFelixAlpn`]).
struct RefuseOnNextPoll {
    polled: bool,
}

impl s2n_quic::provider::tls::default::callbacks::ConnectionFuture for RefuseOnNextPoll {
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        _connection: &mut s2n_quic::provider::tls::default::connection::Connection,
        context: &mut std::task::Context,
    ) -> std::task::Poll<Result<(), s2n_quic::provider::tls::default::error::Error>> {
        if !self.polled {
            self.polled = true;
            context.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(Err(
            s2n_quic::provider::tls::default::error::Error::application(Box::new(NoFelixAlpn)),
        ))
    }
}

/// The TLS configuration of every endpoint: the broker's pair, ALPN `felix/1`, and with a
/// client CA, client certificates requested (optional: a client may use a token instead) and
/// verified against it; a certificate that does not verify fails the TLS handshake.
pub fn server_tls(
    pair: &CertificatePair,
    client_ca: Option<&str>,
) -> Result<s2n_quic::provider::tls::default::Server, BrokerError> {
    use s2n_quic::provider::tls::default::enums::ClientAuthType;
    let tls_error =
        |error: s2n_quic::provider::tls::default::error::Error| BrokerError::Tls(error.to_string());
    let mut builder = s2n_quic::provider::tls::default::Server::builder()
        .with_certificate(pair.cert_pem.as_str(), pair.key_pem.as_str())
        .and_then(|builder| builder.with_application_protocols([felix_wire::ALPN]))
        .map_err(tls_error)?;
    builder
        .config_mut()
        .set_client_hello_callback(RequireFelixAlpn)
        .map_err(tls_error)?;
    if let Some(ca) = client_ca {
        builder = builder
            .with_empty_trust_store()
            .and_then(|builder| builder.with_trusted_certificate(ca))
            .and_then(|builder| builder.with_verify_host_name_callback(AnyClientName))
            .map_err(|error| BrokerError::Setting {
                env: "FELIX_CLIENT_CA",
                value: "(the CA file)".to_owned(),
                reason: error.to_string(),
            })?;
        builder
            .config_mut()
            .set_client_auth_type(ClientAuthType::Optional)
            .map_err(tls_error)?;
    }
    builder.build().map_err(tls_error)
}

/// The broker's pair: FELIX_TLS_CERT/FELIX_TLS_KEY when set, else the development pair at
/// `dev_cert_path()`/`dev_key_path()`, generated (and logged) on first start.
pub fn load_server_pair(config: &Config) -> Result<CertificatePair, BrokerError> {
    if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
        return Ok(CertificatePair {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
        });
    }
    let cert_path = config.dev_cert_path();
    let key_path = config.dev_key_path();
    if cert_path.exists() && key_path.exists() {
        return Ok(CertificatePair {
            cert_pem: read(&cert_path)?,
            key_pem: read(&key_path)?,
        });
    }
    let names: Vec<String> = DEV_CERT_NAMES
        .iter()
        .map(|name| (*name).to_owned())
        .collect();
    let pair = generate_self_signed(&names)?;
    write_pair(&pair, &cert_path, &key_path)?;
    tracing::warn!(
        cert = %cert_path.display(),
        key = %key_path.display(),
        "generated a self-signed development certificate (for local use only; set FELIX_TLS_CERT and FELIX_TLS_KEY in production)"
    );
    Ok(pair)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello body with `extensions` (type, data) after fixed fields.
    fn client_hello(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut hello = vec![3, 3];
        hello.extend_from_slice(&[7; 32]);
        hello.extend_from_slice(&[2, 0xaa, 0xbb]); // session id
        hello.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
        hello.extend_from_slice(&[1, 0]); // null compression
        let mut body = Vec::new();
        for (kind, data) in extensions {
            body.extend_from_slice(&kind.to_be_bytes());
            body.extend_from_slice(&u16::try_from(data.len()).expect("small").to_be_bytes());
            body.extend_from_slice(data);
        }
        hello.extend_from_slice(&u16::try_from(body.len()).expect("small").to_be_bytes());
        hello.extend_from_slice(&body);
        hello
    }

    fn alpn(names: &[&[u8]]) -> Vec<u8> {
        let mut list = Vec::new();
        for name in names {
            list.push(u8::try_from(name.len()).expect("short"));
            list.extend_from_slice(name);
        }
        let mut data = u16::try_from(list.len())
            .expect("small")
            .to_be_bytes()
            .to_vec();
        data.extend_from_slice(&list);
        data
    }

    // Proves the ALPN check finds felix/1 among several protocols and after other
    // extensions, refuses other protocols and a missing extension, and returns None (refused
    // too) for every truncation of a ClientHello instead of panicking.
    #[test]
    fn alpn_is_found_only_where_offered() {
        let good = client_hello(&[(0, vec![0, 0]), (16, alpn(&[b"h3", b"felix/1"]))]);
        assert_eq!(offers_alpn(&good, b"felix/1"), Some(true));
        let other = client_hello(&[(16, alpn(&[b"felix/2", b"h3"]))]);
        assert_eq!(offers_alpn(&other, b"felix/1"), Some(false));
        assert_eq!(offers_alpn(&client_hello(&[]), b"felix/1"), Some(false));
        for cut in 0..good.len() {
            assert_ne!(
                offers_alpn(&good[..cut], b"felix/1"),
                Some(true),
                "cut at {cut}"
            );
        }
    }

    // Proves the key file is written with mode 0600 and both files hold PEM blocks.
    #[test]
    fn write_pair_sets_key_mode_and_writes_pem() {
        let dir = tempfile::tempdir().expect("temp dir");
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        let pair = generate_self_signed(&names).expect("generation works");
        let cert = dir.path().join("tls/cert.pem");
        let key = dir.path().join("tls/key.pem");
        write_pair(&pair, &cert, &key).expect("write works");
        let mode = fs::metadata(&key).expect("key exists").permissions().mode() & 0o777;
        assert_eq!(mode, KEY_FILE_MODE);
        assert!(
            read(&cert)
                .expect("cert")
                .starts_with("-----BEGIN CERTIFICATE-----")
        );
        assert!(read(&key).expect("key").contains("PRIVATE KEY-----"));
    }
}
