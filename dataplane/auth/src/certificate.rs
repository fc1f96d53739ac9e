//! The principal a verified client certificate names (mutual TLS).

use std::net::{Ipv4Addr, Ipv6Addr};

use x509_parser::extensions::GeneralName;
use x509_parser::parse_x509_certificate;

use crate::{AuthError, Principal};

/// The principal a verified client certificate (DER, the leaf) names: the subject's Common
/// Name, else its first subject alternative name that is a DNS name, an e-mail address, a URI
/// or an IP address (as text).
///
/// The TLS stack has already verified the chain; this only reads names. A subject with
/// several Common Names is refused as ambiguous, and a Common Name that is not a valid
/// principal is an error (no fallback to the alternative names: a certificate names one
/// principal or none).
pub fn certificate_principal(leaf_der: &[u8]) -> Result<Principal, AuthError> {
    let (_rest, cert) = parse_x509_certificate(leaf_der).map_err(|error| {
        AuthError::Certificate(format!("not a DER X.509 certificate ({error})"))
    })?;
    let mut common_names = cert.subject().iter_common_name();
    if let Some(common_name) = common_names.next() {
        if common_names.next().is_some() {
            return Err(AuthError::Certificate(
                "the subject has several Common Names".to_owned(),
            ));
        }
        let name = common_name.as_str().map_err(|error| {
            AuthError::Certificate(format!("the Common Name is not text ({error})"))
        })?;
        return Principal::new(name)
            .map_err(|error| AuthError::Certificate(format!("the Common Name is an {error}")));
    }
    let alternative_names = cert
        .subject_alternative_name()
        .map_err(|error| {
            AuthError::Certificate(format!("bad subject alternative name extension ({error})"))
        })?
        .map(|extension| extension.value.general_names.as_slice())
        .unwrap_or_default();
    for general_name in alternative_names {
        let name = match general_name {
            GeneralName::DNSName(name) | GeneralName::RFC822Name(name) | GeneralName::URI(name) => {
                (*name).to_owned()
            }
            GeneralName::IPAddress(bytes) => {
                if let Ok(octets) = <[u8; 4]>::try_from(*bytes) {
                    Ipv4Addr::from(octets).to_string()
                } else if let Ok(octets) = <[u8; 16]>::try_from(*bytes) {
                    Ipv6Addr::from(octets).to_string()
                } else {
                    continue;
                }
            }
            _ => continue,
        };
        return Principal::new(&name).map_err(|error| {
            AuthError::Certificate(format!("the subject alternative name is an {error}"))
        });
    }
    Err(AuthError::Certificate(
        "it has neither a subject Common Name nor a DNS, e-mail, URI or IP subject alternative \
         name"
            .to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};

    use super::*;

    /// A self-signed leaf with this subject Common Name (none if `None`) and these DNS names.
    fn leaf(common_name: Option<&str>, sans: Vec<SanType>) -> Vec<u8> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        if let Some(common_name) = common_name {
            params
                .distinguished_name
                .push(DnType::CommonName, common_name);
        }
        params.subject_alt_names = sans;
        let key = KeyPair::generate().expect("key generation");
        let cert = params.self_signed(&key).expect("self-signing");
        cert.der().to_vec()
    }

    fn dns(name: &str) -> SanType {
        SanType::DnsName(name.try_into().expect("a valid DNS name"))
    }

    /// The Common Name wins over the alternative names.
    #[test]
    fn common_name_first() {
        let der = leaf(Some("alice"), vec![dns("alice.example")]);
        let principal = certificate_principal(&der).expect("a principal");
        assert_eq!(principal.as_str(), "alice");
    }

    /// Without a Common Name, the first alternative name is the principal (DNS or IP).
    #[test]
    fn alternative_name_without_common_name() {
        let der = leaf(None, vec![dns("bob.example"), dns("other.example")]);
        let principal = certificate_principal(&der).expect("a principal");
        assert_eq!(principal.as_str(), "bob.example");
        let der = leaf(None, vec![SanType::IpAddress([10, 0, 0, 7].into())]);
        let principal = certificate_principal(&der).expect("a principal");
        assert_eq!(principal.as_str(), "10.0.0.7");
    }

    /// No name at all, a Common Name that is no principal name, and bytes that are no
    /// certificate are errors, never panics.
    #[test]
    fn refusals() {
        let der = leaf(None, Vec::new());
        let error = certificate_principal(&der).expect_err("no name");
        assert!(matches!(error, AuthError::Certificate(_)));
        assert_eq!(
            error.to_string(),
            "no principal in the client certificate: it has neither a subject Common Name nor \
             a DNS, e-mail, URI or IP subject alternative name"
        );
        let der = leaf(Some("Alice Smith"), Vec::new());
        assert!(matches!(
            certificate_principal(&der),
            Err(AuthError::Certificate(_))
        ));
        for garbage in [
            &[][..],
            &[0x30],
            &[0x30, 0x82, 0xff, 0xff],
            b"not a certificate",
        ] {
            assert!(matches!(
                certificate_principal(garbage),
                Err(AuthError::Certificate(_))
            ));
        }
        let der = leaf(Some("alice"), Vec::new());
        for length in 0..der.len() {
            assert!(certificate_principal(&der[..length]).is_err());
        }
    }
}
