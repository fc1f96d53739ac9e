//! The cluster's certificates: a cluster CA and one certificate per member, with the common
//! name `felix-node-<id>` and both server and client use (each broker is the server of its
//! peers' connections and the client of its own). The peer transport (`transport.rs`) requires
//! and verifies them against the CA on both sides, and takes a peer's member id from its
//! certificate. `felix cluster dev-certs` writes a development set; production clusters use
//! their own CA (docs/cluster.md).

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Private keys are readable by their owner only.
const KEY_FILE_MODE: u32 = 0o600;

/// The common-name prefix of a member's certificate.
pub const NODE_NAME_PREFIX: &str = "felix-node-";

/// Why certificates could not be made or written.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("cannot generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// A member's certificate and key (PEM).
#[derive(Clone)]
pub struct NodeIdentity {
    pub node_id: u64,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("NodeIdentity")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// A cluster CA: its certificate (PEM) and what it signs with.
pub struct ClusterCa {
    pub cert_pem: String,
    pub key_pem: String,
    params: CertificateParams,
    key: KeyPair,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// A new CA named `name` (ECDSA P-256).
    pub fn generate(name: &str) -> Result<ClusterCa, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        Ok(ClusterCa {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            params,
            key,
        })
    }

    /// A certificate for member `node_id`, valid for `names` (IP addresses become IP SANs)
    /// and for the DNS name `felix-node-<id>` (the server name its peers dial it with),
    /// signed by this CA.
    pub fn issue_node(&self, node_id: u64, names: &[String]) -> Result<NodeIdentity, PkiError> {
        let key = KeyPair::generate()?;
        let mut sans = vec![format!("{NODE_NAME_PREFIX}{node_id}")];
        sans.extend(names.iter().cloned());
        let mut params = CertificateParams::new(sans)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{NODE_NAME_PREFIX}{node_id}"));
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok(NodeIdentity {
            node_id,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The member id in a certificate's subject common name `felix-node-<id>` (DER), if any.
#[must_use]
pub fn node_id_of(cert_der: &[u8]) -> Option<u64> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let common_name = cert.subject().iter_common_name().next()?.as_str().ok()?;
    let id: u64 = common_name.strip_prefix(NODE_NAME_PREFIX)?.parse().ok()?;
    (id > 0).then_some(id)
}

fn write_file(path: &Path, contents: &str, key: bool) -> Result<(), PkiError> {
    let error = |source| PkiError::Write {
        path: path.display().to_string(),
        source,
    };
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if key {
        options.mode(KEY_FILE_MODE);
    }
    let mut file = options.open(path).map_err(error)?;
    if key {
        // An existing file keeps its mode through `open`: set it before any key byte.
        file.set_permissions(fs::Permissions::from_mode(KEY_FILE_MODE))
            .map_err(error)?;
    }
    file.write_all(contents.as_bytes()).map_err(error)?;
    file.sync_all().map_err(error)
}

/// Writes a development cluster into `dir` (created if missing): `ca.pem`, `ca.key` and, per
/// member, `node-<id>.pem` and `node-<id>.key` valid for `names`. Keys get mode 0600.
pub fn write_dev_cluster(dir: &Path, nodes: &[u64], names: &[String]) -> Result<(), PkiError> {
    fs::create_dir_all(dir).map_err(|source| PkiError::Write {
        path: dir.display().to_string(),
        source,
    })?;
    let ca = ClusterCa::generate("felix development cluster CA")?;
    write_file(&dir.join("ca.pem"), &ca.cert_pem, false)?;
    write_file(&dir.join("ca.key"), &ca.key_pem, true)?;
    for id in nodes {
        let node = ca.issue_node(*id, names)?;
        write_file(&dir.join(format!("node-{id}.pem")), &node.cert_pem, false)?;
        write_file(&dir.join(format!("node-{id}.key")), &node.key_pem, true)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der_of(pem: &str) -> Vec<u8> {
        let body: String = pem
            .lines()
            .filter(|line| !line.starts_with("-----"))
            .collect();
        decode_base64(&body)
    }

    fn decode_base64(text: &str) -> Vec<u8> {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        let mut buffer = 0u32;
        let mut bits = 0;
        for byte in text.bytes().filter(|b| *b != b'=') {
            let value = ALPHABET.iter().position(|c| *c == byte).expect("base64") as u32;
            buffer = (buffer << 6) | value;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((buffer >> bits) as u8);
                buffer &= (1 << bits) - 1;
            }
        }
        out
    }

    #[test]
    fn a_node_certificate_names_its_member() {
        let ca = ClusterCa::generate("test CA").unwrap();
        let node = ca.issue_node(7, &["127.0.0.1".to_owned()]).unwrap();
        assert_eq!(node_id_of(&der_of(&node.cert_pem)), Some(7));
        assert_eq!(
            node_id_of(&der_of(&ca.cert_pem)),
            None,
            "the CA is no member"
        );
        assert!(!format!("{node:?}").contains("PRIVATE"));
    }

    #[test]
    fn dev_cluster_files_are_written_with_private_keys() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("certs");
        write_dev_cluster(&out, &[1, 2], &["localhost".to_owned()]).unwrap();
        for name in ["ca.pem", "node-1.pem", "node-2.pem"] {
            assert!(
                fs::read_to_string(out.join(name))
                    .unwrap()
                    .contains("CERTIFICATE")
            );
        }
        for name in ["ca.key", "node-1.key", "node-2.key"] {
            let mode = fs::metadata(out.join(name)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{name}");
        }
    }
}
