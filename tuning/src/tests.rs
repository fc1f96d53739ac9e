use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::settings::SETTINGS;
use crate::values::{Kind, format_size, parse_size};
use crate::{Config, ConfigError, Entry, Source, reference_markdown};

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
        .collect()
}

fn load_env(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load(None, env(pairs), &[])
}

fn config_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("create temp config file");
    file.write_all(text.as_bytes())
        .expect("write temp config file");
    file
}

fn entry(config: &Config, env: &str) -> Entry {
    config
        .entries()
        .into_iter()
        .find(|entry| entry.env == env)
        .unwrap_or_else(|| panic!("no entry for {env}"))
}

fn addr(text: &str) -> SocketAddr {
    text.parse().expect("test address")
}

/// Values each kind must refuse, including one just past each bound.
fn bad_values(kind: Kind) -> Vec<String> {
    let fixed: &[&str] = match kind {
        Kind::Size { .. } => &["abc", "", "12XiB", "1.5MiB", "-1", "64mib", "MiB"],
        Kind::Count { .. } => &["abc", "", "1KiB", "-1", "1.5"],
        Kind::Bool => &["yes", "2", "", "on"],
        Kind::Addr => &["abc", "", "localhost:7400", "127.0.0.1"],
        Kind::AddrOrOff => &["on", "", "127.0.0.1"],
        Kind::Path => &["", "a\0b"],
        Kind::OptionalPath => &["a\0b"],
        Kind::Text { .. } => &["", "   "],
        Kind::Choice { .. } => &["", "On_Commit", "always", " periodic"],
        Kind::TextList { .. } => &["a\0b", "alice publish \u{1b}[31m*"],
        Kind::Secret { .. } => &["felix_a b", "felix_a\tb", "felix_\u{e9}_x", " felix_a_b"],
    };
    let mut values: Vec<String> = fixed.iter().map(|value| (*value).to_owned()).collect();
    if let Kind::Secret { .. } = kind {
        // One byte longer than the protocol lets a Hello carry.
        values.push(format!("felix_{}", "x".repeat(1024 - "felix_".len() + 1)));
    }
    if let Kind::Size { min, max } | Kind::Count { min, max } = kind {
        values.push((max + 1).to_string());
        if min > 0 {
            values.push((min - 1).to_string());
        }
    }
    values
}

#[test]
fn defaults_are_the_documented_values() {
    // With no file, no FELIX_* variables and no flags, every field has its documented default.
    let config = load_env(&[("HOME", "/home/ada"), ("PATH", "/usr/bin")]).expect("defaults load");
    assert_eq!(config.bind, addr("127.0.0.1:7400"));
    assert_eq!(config.metrics_bind, Some(addr("127.0.0.1:9400")));
    assert_eq!(
        config.data_dir,
        PathBuf::from("/home/ada/.local/share/felix")
    );
    assert_eq!(config.tls_cert, None);
    assert_eq!(config.tls_key, None);
    assert_eq!(config.replay_ring_max_bytes, 64 << 20);
    assert_eq!(config.replay_ring_max_records, 1024);
    assert_eq!(config.durable_fsync_mode, "periodic");
    assert_eq!(config.durable_fsync_interval_ms, 250);
    assert!(config.storage_io_uring);
    assert!(config.storage_direct_io);
    assert_eq!(config.storage_rounds_in_flight, 2);
    assert_eq!(config.durable_segment_bytes, 1 << 30);
    assert_eq!(config.durable_retention_bytes, 0);
    assert_eq!(config.durable_retention_seconds, 0);
    assert_eq!(config.max_frame_bytes, 16 << 20);
    assert_eq!(config.max_batch_records, 4096);
    assert_eq!(config.subscriber_queue_max_bytes, 64 << 20);
    assert_eq!(config.log, "info");
    assert_eq!(config.addr, addr("127.0.0.1:7400"));
    assert_eq!(config.server_name, "localhost");
    assert_eq!(config.ca, None);
    assert!(!config.insecure);
    assert_eq!(config.publish_inflight_bytes, 4 << 20);
    assert_eq!(config.auth, "off");
    assert_eq!(config.client_ca, None);
    assert_eq!(config.tokens_file, None);
    assert_eq!(config.rules, "");
    assert_eq!(config.max_connections_per_core, 10_000);
    assert_eq!(config.max_connections_per_principal, 1024);
    assert_eq!(config.max_streams, 1024);
    assert_eq!(config.max_shards_per_stream, 1024);
    assert_eq!(config.max_streams_per_connection, 256);
    assert_eq!(config.max_subscriptions_per_connection, 64);
    assert_eq!(config.hello_timeout_ms, 10_000);
    assert_eq!(config.hello_max_bytes, 16 << 10);
    assert_eq!(config.idle_timeout_ms, 30_000);
    assert_eq!(config.max_key_bytes, 1024);
    assert_eq!(config.max_payload_bytes, 4 << 20);
    assert_eq!(config.token, None);
    assert_eq!(config.client_cert, None);
    assert_eq!(config.client_key, None);
    let entries = config.entries();
    assert_eq!(entries.len(), SETTINGS.len());
    assert!(entries.iter().all(|entry| entry.source == Source::Default));
    assert_eq!(entry(&config, "FELIX_REPLAY_RING_MAX_BYTES").value, "64MiB");
    assert_eq!(entry(&config, "FELIX_METRICS_BIND").value, "127.0.0.1:9400");
    assert_eq!(entry(&config, "FELIX_TLS_CERT").value, "");
    assert_eq!(entry(&config, "FELIX_INSECURE").value, "0");
    assert_eq!(entry(&config, "FELIX_HELLO_MAX_BYTES").value, "16KiB");
    assert_eq!(entry(&config, "FELIX_MAX_PAYLOAD_BYTES").value, "4MiB");
    assert_eq!(entry(&config, "FELIX_RULES").value, "");
    assert_eq!(entry(&config, "FELIX_TOKEN").value, "");
}

#[test]
fn tls_paths_derive_from_the_data_dir() {
    // The development pair and the default CA live under <data_dir>/tls/; FELIX_CA overrides.
    let config = load_env(&[("FELIX_DATA_DIR", "/var/lib/felix")]).expect("load");
    assert_eq!(
        config.dev_cert_path(),
        Path::new("/var/lib/felix/tls/dev-cert.pem")
    );
    assert_eq!(
        config.dev_key_path(),
        Path::new("/var/lib/felix/tls/dev-key.pem")
    );
    assert_eq!(config.ca_path(), config.dev_cert_path());
    assert_eq!(
        entry(&config, "FELIX_CA").value,
        "/var/lib/felix/tls/dev-cert.pem"
    );
    let config = load_env(&[("FELIX_CA", "/etc/felix/ca.pem")]).expect("load");
    assert_eq!(config.ca_path(), Path::new("/etc/felix/ca.pem"));
    assert_eq!(entry(&config, "FELIX_CA").value, "/etc/felix/ca.pem");
}

#[test]
fn data_dir_default_follows_xdg_then_home_then_cwd() {
    // The default data directory comes from the env given to load, in XDG order.
    let both = load_env(&[("XDG_DATA_HOME", "/xdg/"), ("HOME", "/home/ada")]).expect("load");
    assert_eq!(both.data_dir, Path::new("/xdg/felix"));
    let relative_xdg = load_env(&[("XDG_DATA_HOME", "rel"), ("HOME", "/home/ada")]).expect("load");
    assert_eq!(
        relative_xdg.data_dir,
        Path::new("/home/ada/.local/share/felix")
    );
    let neither = load_env(&[("HOME", "")]).expect("load");
    assert_eq!(neither.data_dir, Path::new("./felix-data"));
    assert_eq!(entry(&neither, "FELIX_DATA_DIR").source, Source::Default);
}

#[test]
fn each_layer_overrides_the_one_below() {
    // file beats default, environment beats file, a flag beats the environment, and entries
    // report each value's source.
    let file = config_file(
        "bind = \"0.0.0.0:7500\"\n\
         replay_ring_max_bytes = \"1MiB\"\n\
         max_batch_records = 64\n\
         insecure = true\n\
         server_name = \"broker.example\"\n",
    );
    let path = file.path();
    let env_vars = env(&[
        ("FELIX_REPLAY_RING_MAX_BYTES", "2MiB"),
        ("FELIX_MAX_BATCH_RECORDS", "128"),
    ]);
    let flags = [("FELIX_MAX_BATCH_RECORDS", "256".to_owned())];
    let config = Config::load(Some(path), env_vars, &flags).expect("layers load");

    assert_eq!(config.bind, addr("0.0.0.0:7500"));
    assert_eq!(config.replay_ring_max_bytes, 2 << 20);
    assert_eq!(config.max_batch_records, 256);
    assert!(config.insecure);
    assert_eq!(config.server_name, "broker.example");
    assert_eq!(config.log, "info");

    let file_source = Source::File(path.to_path_buf());
    assert_eq!(entry(&config, "FELIX_BIND").source, file_source);
    assert_eq!(entry(&config, "FELIX_SERVER_NAME").source, file_source);
    assert_eq!(
        entry(&config, "FELIX_REPLAY_RING_MAX_BYTES"),
        Entry {
            env: "FELIX_REPLAY_RING_MAX_BYTES",
            value: "2MiB".to_owned(),
            source: Source::Env("FELIX_REPLAY_RING_MAX_BYTES".to_owned()),
        }
    );
    assert_eq!(
        entry(&config, "FELIX_MAX_BATCH_RECORDS").source,
        Source::Flag
    );
    assert_eq!(entry(&config, "FELIX_MAX_BATCH_RECORDS").value, "256");
    assert_eq!(entry(&config, "FELIX_INSECURE").value, "1");
    assert_eq!(entry(&config, "FELIX_LOG").source, Source::Default);
}

#[test]
fn later_flag_wins() {
    // Two flags for one setting: the last one given applies.
    let flags = [
        ("FELIX_LOG", "debug".to_owned()),
        ("FELIX_LOG", "warn".to_owned()),
    ];
    let config = Config::load(None, Vec::new(), &flags).expect("load");
    assert_eq!(config.log, "warn");
}

#[test]
fn felix_config_names_the_file_unless_one_is_given() {
    // FELIX_CONFIG supplies the file path; an explicit path takes precedence over it.
    let from_env = config_file("log = \"debug\"\n");
    let explicit = config_file("log = \"trace\"\n");
    let env_path = from_env.path().to_str().expect("utf-8 temp path");
    let config = load_env(&[("FELIX_CONFIG", env_path)]).expect("load");
    assert_eq!(config.log, "debug");
    assert_eq!(
        entry(&config, "FELIX_LOG").source,
        Source::File(from_env.path().to_path_buf())
    );
    let config = Config::load(
        Some(explicit.path()),
        env(&[("FELIX_CONFIG", env_path)]),
        &[],
    )
    .expect("load");
    assert_eq!(config.log, "trace");
    let config = load_env(&[("FELIX_CONFIG", "")]).expect("empty FELIX_CONFIG means no file");
    assert_eq!(config.log, "info");
}

#[test]
fn empty_optional_path_unsets_a_lower_layer() {
    // FELIX_TLS_CERT= and FELIX_TLS_KEY= in the environment clear a pair set in the file.
    let file =
        config_file("tls_cert = \"/etc/felix/cert.pem\"\ntls_key = \"/etc/felix/key.pem\"\n");
    let config = Config::load(Some(file.path()), Vec::new(), &[]).expect("load");
    assert_eq!(config.tls_cert, Some(PathBuf::from("/etc/felix/cert.pem")));
    let cleared = env(&[("FELIX_TLS_CERT", ""), ("FELIX_TLS_KEY", "")]);
    let config = Config::load(Some(file.path()), cleared, &[]).expect("load");
    assert_eq!(config.tls_cert, None);
    assert_eq!(config.tls_key, None);
}

#[test]
fn every_setting_rejects_bad_values_naming_its_variable() {
    // Each setting refuses garbage and out-of-range values with a message naming the variable,
    // the value, the environment as source, and what is accepted.
    for setting in SETTINGS {
        let bad = bad_values(setting.kind);
        assert!(!bad.is_empty(), "{} has no bad value to test", setting.env);
        for value in bad {
            let error = load_env(&[(setting.env, &value)])
                .expect_err(&format!("{}={value:?} must be refused", setting.env));
            assert!(
                matches!(&error, ConfigError::Invalid { env, .. } if *env == setting.env),
                "{}={value:?}: {error:?}",
                setting.env
            );
            let message = error.to_string();
            let shown = if setting.kind.is_secret() {
                assert!(!message.contains(value.trim()), "secret echoed: {message}");
                assert!(!format!("{error:?}").contains(value.trim()), "{error:?}");
                "(hidden)".to_owned()
            } else {
                format!("{value:?}")
            };
            let quoted = format!(
                "{}={shown} (from environment) is invalid: expected ",
                setting.env
            );
            assert!(message.starts_with(&quoted), "{message}");
            assert!(message.contains(&setting.kind.accepts()), "{message}");
        }
    }
}

#[test]
fn numeric_bounds_are_inclusive() {
    // The minimum and maximum of every numeric setting are accepted (with the largest frame
    // and the smallest payload bound as the background, so the payload-fits-frame check
    // passes at both ends of either).
    for setting in SETTINGS {
        if let Kind::Size { min, max } | Kind::Count { min, max } = setting.kind {
            for value in [min, max] {
                let value_text = value.to_string();
                let config = load_env(&[
                    ("FELIX_MAX_FRAME_BYTES", "64MiB"),
                    ("FELIX_MAX_PAYLOAD_BYTES", "1KiB"),
                    (setting.env, &value_text),
                ])
                .unwrap_or_else(|error| panic!("{}={value}: {error}", setting.env));
                let rendered = entry(&config, setting.env).value;
                let expected = match setting.kind {
                    Kind::Size { .. } => format_size(value),
                    _ => value.to_string(),
                };
                assert_eq!(rendered, expected);
            }
        }
    }
}

#[test]
fn invalid_value_message_matches_the_documented_form() {
    // The message has the exact shape operators see.
    let error = load_env(&[("FELIX_REPLAY_RING_MAX_BYTES", "abc")]).expect_err("abc is no size");
    assert_eq!(
        error.to_string(),
        "FELIX_REPLAY_RING_MAX_BYTES=\"abc\" (from environment) is invalid: expected a byte size \
         from 0 to 1TiB, such as 67108864 or 64MiB"
    );
}

#[test]
fn invalid_values_from_file_and_flag_name_their_source() {
    // A bad file value names the file; a bad flag value says it came from a flag.
    let file = config_file("max_frame_bytes = 1024\n");
    let error = Config::load(Some(file.path()), Vec::new(), &[]).expect_err("too small");
    let message = error.to_string();
    assert!(
        message.starts_with("FELIX_MAX_FRAME_BYTES=\"1024\" (from file "),
        "{message}"
    );
    assert!(
        message.contains(&file.path().display().to_string()),
        "{message}"
    );
    assert!(message.contains("from 64KiB to 64MiB"), "{message}");

    let flags = [("FELIX_METRICS_BIND", "nowhere".to_owned())];
    let error = Config::load(None, Vec::new(), &flags).expect_err("not an address");
    assert!(
        error
            .to_string()
            .starts_with("FELIX_METRICS_BIND=\"nowhere\" (from command-line flag)"),
        "{error}"
    );
}

#[test]
fn file_value_of_wrong_toml_type_is_refused() {
    // An array or table where a scalar belongs names the variable, key, file and TOML type.
    let file = config_file("server_name = [\"a\", \"b\"]\n");
    let error = Config::load(Some(file.path()), Vec::new(), &[]).expect_err("array");
    let message = error.to_string();
    assert!(
        message.starts_with("FELIX_SERVER_NAME (key `server_name` in config file "),
        "{message}"
    );
    assert!(message.contains("is a TOML array"), "{message}");
}

#[test]
fn unknown_felix_variable_is_refused() {
    // A misspelt FELIX_* variable stops loading and is named; FELIX_CONFIG and non-FELIX
    // variables are not settings and pass.
    let error = load_env(&[("FELIX_REPLAY_RING_MAX_BYTE", "1")]).expect_err("typo");
    assert!(
        matches!(&error, ConfigError::UnknownEnv { name } if name == "FELIX_REPLAY_RING_MAX_BYTE")
    );
    assert_eq!(
        error.to_string(),
        "unknown setting FELIX_REPLAY_RING_MAX_BYTE; `felix config` lists the known ones"
    );
    load_env(&[("FELIX_CONFIG", ""), ("RUST_LOG", "x"), ("FELIXIR", "y")]).expect("not settings");
}

#[test]
fn unknown_file_key_is_refused() {
    // A key matching no setting names the key and the file.
    let file = config_file("bind = \"127.0.0.1:7400\"\nreplay_ring_bytes = \"1MiB\"\n");
    let error = Config::load(Some(file.path()), Vec::new(), &[]).expect_err("unknown key");
    assert!(
        matches!(&error, ConfigError::UnknownFileKey { key, .. } if key == "replay_ring_bytes")
    );
    let message = error.to_string();
    assert!(message.contains("`replay_ring_bytes`"), "{message}");
    assert!(
        message.contains(&file.path().display().to_string()),
        "{message}"
    );
    // Variable names are not file keys.
    let file = config_file("FELIX_BIND = \"127.0.0.1:7400\"\n");
    let error = Config::load(Some(file.path()), Vec::new(), &[]).expect_err("env name as key");
    assert!(matches!(error, ConfigError::UnknownFileKey { .. }));
}

#[test]
fn unknown_flag_is_refused() {
    // The CLI mapping a flag to a name that is no setting is an error, not ignored.
    let flags = [("FELIX_NOPE", "1".to_owned())];
    let error = Config::load(None, Vec::new(), &flags).expect_err("unknown flag");
    assert!(matches!(&error, ConfigError::UnknownFlag { name } if name == "FELIX_NOPE"));
}

#[test]
fn missing_or_broken_file_is_named() {
    // A named file that cannot be read or is not TOML stops loading, naming the file.
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("absent.toml");
    let error = Config::load(Some(&missing), Vec::new(), &[]).expect_err("missing file");
    assert!(matches!(error, ConfigError::ReadFile { .. }));
    assert!(
        error.to_string().contains(&missing.display().to_string()),
        "{error}"
    );

    let broken = config_file("bind = \n");
    let error = Config::load(Some(broken.path()), Vec::new(), &[]).expect_err("bad TOML");
    assert!(matches!(error, ConfigError::ParseFile { .. }));
    assert!(
        error
            .to_string()
            .contains(&broken.path().display().to_string()),
        "{error}"
    );
}

#[test]
fn size_suffixes_parse() {
    // Sizes take plain bytes or KiB/MiB/GiB/TiB; anything else, and overflow, is refused.
    let cases: [(&str, Option<u64>); 14] = [
        ("0", Some(0)),
        ("67108864", Some(64 << 20)),
        ("64MiB", Some(64 << 20)),
        ("64 MiB", Some(64 << 20)),
        (" 4KiB ", Some(4096)),
        ("3GiB", Some(3 << 30)),
        ("1TiB", Some(1 << 40)),
        ("16777215TiB", Some(16_777_215 << 40)),
        ("16777216TiB", None),
        ("18446744073709551616", None),
        ("64MB", None),
        ("64mib", None),
        ("MiB", None),
        ("+5", None),
    ];
    for (text, expected) in cases {
        assert_eq!(parse_size(text), expected, "{text:?}");
    }
}

#[test]
fn sizes_render_with_the_largest_exact_suffix() {
    // Rendering picks the largest exact suffix and parses back to the same number.
    for (bytes, text) in [
        (0, "0"),
        (1000, "1000"),
        (4096, "4KiB"),
        (64 << 20, "64MiB"),
        (1 << 40, "1TiB"),
        (1536 << 10, "1536KiB"),
    ] {
        assert_eq!(format_size(bytes), text);
        assert_eq!(parse_size(text), Some(bytes));
    }
}

#[test]
fn booleans_accept_0_1_true_false() {
    // The four documented spellings, from the environment and as a TOML boolean.
    for (text, expected) in [("1", true), ("true", true), ("0", false), ("false", false)] {
        assert_eq!(
            load_env(&[("FELIX_INSECURE", text)])
                .expect("load")
                .insecure,
            expected
        );
    }
    let file = config_file("insecure = false\n");
    let config = Config::load(Some(file.path()), env(&[]), &[]).expect("load");
    assert!(!config.insecure);
}

#[test]
fn metrics_bind_accepts_off() {
    // `off` disables the metrics endpoint and renders back as `off`.
    let config = load_env(&[("FELIX_METRICS_BIND", "off")]).expect("load");
    assert_eq!(config.metrics_bind, None);
    assert_eq!(entry(&config, "FELIX_METRICS_BIND").value, "off");
    let config = load_env(&[("FELIX_METRICS_BIND", "[::1]:9500")]).expect("load");
    assert_eq!(config.metrics_bind, Some(addr("[::1]:9500")));
}

#[test]
fn tls_cert_and_key_come_as_a_pair() {
    // One of FELIX_TLS_CERT / FELIX_TLS_KEY without the other is refused, naming both; both
    // or neither load, whichever layers they come from.
    let error = load_env(&[("FELIX_TLS_CERT", "/c.pem")]).expect_err("cert alone");
    assert!(matches!(
        &error,
        ConfigError::TlsPairIncomplete {
            set: "FELIX_TLS_CERT",
            missing: "FELIX_TLS_KEY",
            ..
        }
    ));
    let message = error.to_string();
    assert!(
        message.starts_with("FELIX_TLS_CERT is set (from environment) but FELIX_TLS_KEY is not"),
        "{message}"
    );

    let flags = [("FELIX_TLS_KEY", "/k.pem".to_owned())];
    let error = Config::load(None, Vec::new(), &flags).expect_err("key alone");
    assert!(matches!(
        error,
        ConfigError::TlsPairIncomplete {
            set: "FELIX_TLS_KEY",
            missing: "FELIX_TLS_CERT",
            origin: Source::Flag
        }
    ));

    let file = config_file("tls_cert = \"/c.pem\"\n");
    let config = Config::load(Some(file.path()), env(&[("FELIX_TLS_KEY", "/k.pem")]), &[])
        .expect("cert from file, key from environment");
    assert_eq!(config.tls_cert, Some(PathBuf::from("/c.pem")));
    assert_eq!(config.tls_key, Some(PathBuf::from("/k.pem")));
}

#[test]
fn render_table_aligns_columns() {
    // `felix config` text: a header, one line per setting, VALUE and SOURCE columns aligned.
    let config = load_env(&[("FELIX_LOG", "debug")]).expect("load");
    let table = config.render_table();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), SETTINGS.len() + 1);
    assert!(lines[0].starts_with("NAME "), "{}", lines[0]);
    let value_column = lines[0].find("VALUE").expect("VALUE header");
    let source_column = lines[0].find("SOURCE").expect("SOURCE header");
    for (line, setting) in lines[1..].iter().zip(SETTINGS) {
        assert!(line.starts_with(setting.env), "{line}");
        assert_eq!(line.as_bytes()[value_column - 1], b' ', "{line}");
        assert_ne!(line.as_bytes()[value_column], b' ', "{line}");
        assert_ne!(line.as_bytes()[source_column], b' ', "{line}");
    }
    let log_line = lines
        .iter()
        .find(|line| line.starts_with("FELIX_LOG "))
        .expect("log line");
    assert!(log_line.ends_with("environment"), "{log_line}");
    let cert_line = lines
        .iter()
        .find(|line| line.starts_with("FELIX_TLS_CERT "))
        .expect("cert");
    assert!(cert_line.contains("(unset)"), "{cert_line}");
}

#[test]
fn every_default_parses_through_its_own_setting() {
    // The table's defaults are valid values of their kinds (and each kind fits its field).
    let config = load_env(&[]).expect("defaults load");
    for entry in config.entries() {
        load_env(&[(entry.env, &entry.value)]).unwrap_or_else(|error| {
            panic!("rendered default of {} does not parse: {error}", entry.env)
        });
    }
}

#[test]
fn reference_lists_every_setting_once() {
    // The generated reference has one row per setting, with its file key.
    let reference = reference_markdown();
    for setting in SETTINGS {
        let row = format!("| `{}` | `{}` |", setting.env, setting.file_key());
        assert_eq!(reference.matches(&row).count(), 1, "{row}");
    }
    assert_eq!(reference.lines().count(), SETTINGS.len() + 3);
}

#[test]
fn docs_contain_the_generated_reference_verbatim() {
    // docs/configuration.md embeds reference_markdown() unchanged, so the doc cannot drift
    // from the settings table. Regenerate with `cargo run -p felix-tuning --example reference`.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
    let doc = std::fs::read_to_string(path).expect("read docs/configuration.md");
    assert!(
        doc.contains(&reference_markdown()),
        "docs/configuration.md is out of date with the settings table; paste the output of \
         `cargo run -p felix-tuning --example reference` over its reference section"
    );
}

#[test]
fn docs_config_file_example_loads() {
    // The TOML example in docs/configuration.md is a valid config file.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
    let doc = std::fs::read_to_string(path).expect("read docs/configuration.md");
    let start = doc.find("```toml\n").expect("a toml example") + "```toml\n".len();
    let end = start + doc[start..].find("```").expect("end of the toml example");
    let file = config_file(&doc[start..end]);
    let config = Config::load(Some(file.path()), Vec::new(), &[]).expect("doc example loads");
    assert_eq!(config.replay_ring_max_bytes, 256 << 20);
    assert_eq!(config.metrics_bind, None);
    assert_eq!(
        config.rules,
        "alice publish,subscribe orders.*\nops admin *"
    );
}

#[test]
fn new_limit_settings_take_values_from_the_environment() {
    // Each authentication, authorization and limit setting reaches its field from FELIX_*.
    let config = load_env(&[
        ("FELIX_AUTH", "required"),
        ("FELIX_CLIENT_CA", "/etc/felix/clients-ca.pem"),
        ("FELIX_TOKENS_FILE", "/etc/felix/tokens"),
        ("FELIX_RULES", "alice publish orders.*"),
        ("FELIX_MAX_CONNECTIONS_PER_CORE", "5"),
        ("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL", "0"),
        ("FELIX_MAX_STREAMS", "65536"),
        ("FELIX_MAX_SHARDS_PER_STREAM", "4096"),
        ("FELIX_MAX_STREAMS_PER_CONNECTION", "8"),
        ("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION", "2"),
        ("FELIX_HELLO_TIMEOUT_MS", "100"),
        ("FELIX_HELLO_MAX_BYTES", "2KiB"),
        ("FELIX_IDLE_TIMEOUT_MS", "1000"),
        ("FELIX_MAX_KEY_BYTES", "65535"),
        ("FELIX_MAX_PAYLOAD_BYTES", "1MiB"),
        ("FELIX_TOKEN", "felix_0123_abc-DEF_xyz"),
        ("FELIX_CLIENT_CERT", "/home/ada/client.pem"),
        ("FELIX_CLIENT_KEY", "/home/ada/client-key.pem"),
    ])
    .expect("load");
    assert_eq!(config.auth, "required");
    assert_eq!(
        config.client_ca,
        Some(PathBuf::from("/etc/felix/clients-ca.pem"))
    );
    assert_eq!(config.tokens_file, Some(PathBuf::from("/etc/felix/tokens")));
    assert_eq!(config.rules, "alice publish orders.*");
    assert_eq!(config.max_connections_per_core, 5);
    assert_eq!(config.max_connections_per_principal, 0);
    assert_eq!(config.max_streams, 65_536);
    assert_eq!(config.max_shards_per_stream, 4096);
    assert_eq!(config.max_streams_per_connection, 8);
    assert_eq!(config.max_subscriptions_per_connection, 2);
    assert_eq!(config.hello_timeout_ms, 100);
    assert_eq!(config.hello_max_bytes, 2048);
    assert_eq!(config.idle_timeout_ms, 1000);
    assert_eq!(config.max_key_bytes, u16::MAX);
    assert_eq!(config.max_payload_bytes, 1 << 20);
    assert_eq!(config.token.as_deref(), Some("felix_0123_abc-DEF_xyz"));
    assert_eq!(
        config.client_cert,
        Some(PathBuf::from("/home/ada/client.pem"))
    );
    assert_eq!(
        config.client_key,
        Some(PathBuf::from("/home/ada/client-key.pem"))
    );
}

#[test]
fn new_settings_refuse_a_bad_value_naming_the_variable() {
    // One plainly wrong value per new setting stops loading with Invalid naming its variable.
    let cases = [
        ("FELIX_AUTH", "on"),
        ("FELIX_CLIENT_CA", "a\0b"),
        ("FELIX_TOKENS_FILE", "a\0b"),
        ("FELIX_RULES", "a\0b"),
        ("FELIX_MAX_CONNECTIONS_PER_CORE", "0"),
        ("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL", "1000001"),
        ("FELIX_MAX_STREAMS", "65537"),
        ("FELIX_MAX_SHARDS_PER_STREAM", "4097"),
        ("FELIX_MAX_STREAMS_PER_CONNECTION", "0"),
        ("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION", "65537"),
        ("FELIX_HELLO_TIMEOUT_MS", "99"),
        ("FELIX_HELLO_MAX_BYTES", "2MiB"),
        ("FELIX_IDLE_TIMEOUT_MS", "999"),
        ("FELIX_MAX_KEY_BYTES", "65536"),
        ("FELIX_MAX_PAYLOAD_BYTES", "128MiB"),
        ("FELIX_TOKEN", "not a token"),
        ("FELIX_CLIENT_CERT", "a\0b"),
        ("FELIX_CLIENT_KEY", "a\0b"),
    ];
    for (name, value) in cases {
        let error = load_env(&[(name, value)]).expect_err(&format!("{name}={value:?}"));
        assert!(
            matches!(&error, ConfigError::Invalid { env, .. } if *env == name),
            "{name}={value:?}: {error:?}"
        );
        assert!(
            error.to_string().starts_with(&format!("{name}=")),
            "{error}"
        );
    }
}

#[test]
fn rules_come_from_a_string_or_an_array_of_strings() {
    // FELIX_RULES loads from an env string, a TOML string, or a TOML array joined one
    // element per line.
    let config = load_env(&[("FELIX_RULES", "alice publish orders.*\nops admin *")])
        .expect("string from the environment");
    assert_eq!(config.rules, "alice publish orders.*\nops admin *");

    let file =
        config_file("rules = [\n  \"alice publish,subscribe orders.*\",\n  \"ops admin *\",\n]\n");
    let config = Config::load(Some(file.path()), Vec::new(), &[]).expect("array from the file");
    assert_eq!(
        config.rules,
        "alice publish,subscribe orders.*\nops admin *"
    );
    assert_eq!(
        entry(&config, "FELIX_RULES").source,
        Source::File(file.path().to_path_buf())
    );

    let file = config_file("rules = \"alice publish orders.*\"\n");
    let config = Config::load(Some(file.path()), Vec::new(), &[]).expect("string from the file");
    assert_eq!(config.rules, "alice publish orders.*");

    let file = config_file("rules = []\n");
    let config = Config::load(Some(file.path()), Vec::new(), &[]).expect("empty array");
    assert_eq!(config.rules, "");
}

#[test]
fn rules_array_with_a_non_string_element_is_refused() {
    // A non-string element in the FELIX_RULES array is a FileValueType error naming it.
    let file = config_file("rules = [\"alice publish *\", 7]\n");
    let error = Config::load(Some(file.path()), Vec::new(), &[]).expect_err("integer element");
    assert!(
        matches!(
            &error,
            ConfigError::FileValueType {
                env: "FELIX_RULES",
                ..
            }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.starts_with("FELIX_RULES (key `rules` in config file "),
        "{message}"
    );
    assert!(
        message.contains("is a TOML array with an integer element"),
        "{message}"
    );
    assert!(message.contains("an array of strings"), "{message}");
    // Other settings still refuse arrays outright.
    let file = config_file("auth = [\"off\"]\n");
    let error = Config::load(Some(file.path()), Vec::new(), &[]).expect_err("array for auth");
    assert!(matches!(
        error,
        ConfigError::FileValueType {
            env: "FELIX_AUTH",
            found: "array",
            ..
        }
    ));
}

#[test]
fn multi_line_rules_stay_on_one_line_of_felix_config() {
    // A rules value with line breaks is shown escaped, so the table keeps one line a setting.
    let config = load_env(&[("FELIX_RULES", "alice publish *\nbob subscribe *")]).expect("load");
    let table = config.render_table();
    assert_eq!(table.lines().count(), SETTINGS.len() + 1);
    assert!(
        table.contains("alice publish *\\nbob subscribe *"),
        "{table}"
    );
}

#[test]
fn token_is_never_printed() {
    // FELIX_TOKEN is (hidden)/(unset) in entries, the table, Debug and Invalid errors.
    let secret = "felix_0123_s3cretSECRETs3cret";
    let flags = [("FELIX_TOKEN", secret.to_owned())];
    let config = Config::load(None, Vec::new(), &flags).expect("load");
    assert_eq!(config.token.as_deref(), Some(secret));
    assert_eq!(entry(&config, "FELIX_TOKEN").value, "(hidden)");
    let table = config.render_table();
    assert!(!table.contains(secret), "{table}");
    let line = table
        .lines()
        .find(|line| line.starts_with("FELIX_TOKEN "))
        .expect("token line");
    assert!(line.contains("(hidden)"), "{line}");
    assert!(line.ends_with("command-line flag"), "{line}");
    let debug = format!("{config:?}");
    assert!(!debug.contains(secret), "{debug}");
    assert!(debug.contains("token: (hidden)"), "{debug}");

    let unset = load_env(&[]).expect("load");
    let table = unset.render_table();
    let line = table
        .lines()
        .find(|line| line.starts_with("FELIX_TOKEN "))
        .expect("token line");
    assert!(line.contains("(unset)"), "{line}");

    let bad = "felix_0123_s3cret with a space";
    let error = load_env(&[("FELIX_TOKEN", bad)]).expect_err("space in token");
    assert_eq!(
        error.to_string(),
        "FELIX_TOKEN=(hidden) (from environment) is invalid: expected a bearer token \
         (felix_<id>_<secret>)"
    );
    assert!(!format!("{error:?}").contains("s3cret"), "{error:?}");
}

#[test]
fn payload_larger_than_frame_is_refused_naming_both() {
    // A payload bound above the frame bound is refused naming both and their sources.
    let file = config_file("max_frame_bytes = \"1MiB\"\n");
    let error = Config::load(
        Some(file.path()),
        env(&[("FELIX_MAX_PAYLOAD_BYTES", "2MiB")]),
        &[],
    )
    .expect_err("payload over frame");
    assert!(
        matches!(
            &error,
            ConfigError::PayloadExceedsFrame {
                payload: 2_097_152,
                frame: 1_048_576,
                payload_origin: Source::Env(_),
                frame_origin: Source::File(_),
            }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    let expected_start = format!(
        "FELIX_MAX_PAYLOAD_BYTES=2MiB (from environment) exceeds FELIX_MAX_FRAME_BYTES=1MiB \
         (from file {}): a record must fit in one frame",
        file.path().display()
    );
    assert!(message.starts_with(&expected_start), "{message}");

    // The default payload bound (4 MiB) does not fit a 1 MiB frame either.
    let error = load_env(&[("FELIX_MAX_FRAME_BYTES", "1MiB")]).expect_err("default payload");
    assert!(
        error
            .to_string()
            .starts_with("FELIX_MAX_PAYLOAD_BYTES=4MiB (from default) exceeds"),
        "{error}"
    );

    let config = load_env(&[
        ("FELIX_MAX_FRAME_BYTES", "1MiB"),
        ("FELIX_MAX_PAYLOAD_BYTES", "1MiB"),
    ])
    .expect("equal bounds load");
    assert_eq!(config.max_payload_bytes, config.max_frame_bytes);
}

#[test]
fn client_cert_and_key_come_as_a_pair() {
    // FELIX_CLIENT_CERT and FELIX_CLIENT_KEY load both or neither; one alone names both.
    let error = load_env(&[("FELIX_CLIENT_CERT", "/c.pem")]).expect_err("cert alone");
    assert!(matches!(
        &error,
        ConfigError::ClientCertPairIncomplete {
            set: "FELIX_CLIENT_CERT",
            missing: "FELIX_CLIENT_KEY",
            origin: Source::Env(_),
        }
    ));
    assert!(
        error.to_string().starts_with(
            "FELIX_CLIENT_CERT is set (from environment) but FELIX_CLIENT_KEY is not: set both"
        ),
        "{error}"
    );
    let flags = [("FELIX_CLIENT_KEY", "/k.pem".to_owned())];
    let error = Config::load(None, Vec::new(), &flags).expect_err("key alone");
    assert!(matches!(
        error,
        ConfigError::ClientCertPairIncomplete {
            set: "FELIX_CLIENT_KEY",
            missing: "FELIX_CLIENT_CERT",
            origin: Source::Flag
        }
    ));
    let config = load_env(&[
        ("FELIX_CLIENT_CERT", "/c.pem"),
        ("FELIX_CLIENT_KEY", "/k.pem"),
    ])
    .expect("both");
    assert_eq!(config.client_cert, Some(PathBuf::from("/c.pem")));
    assert_eq!(config.client_key, Some(PathBuf::from("/k.pem")));
}

#[test]
fn auth_summary_of_the_open_default() {
    // The open default (comment-only rules included) says anyone may do anything.
    let expected = "auth: off (no client certificate CA, no tokens file, no rules): any client \
                    that reaches the broker may create, delete, publish to and read every stream";
    assert_eq!(load_env(&[]).expect("load").auth_summary(), expected);
    let comments = load_env(&[("FELIX_RULES", " ; # nothing yet\n\n")]).expect("load");
    assert_eq!(comments.auth_summary(), expected);
}

#[test]
fn auth_summary_of_a_configured_broker() {
    // A configured broker's summary names the mode, the CA, the tokens file and counts rules.
    let config = load_env(&[
        ("FELIX_AUTH", "required"),
        ("FELIX_CLIENT_CA", "/etc/felix/clients-ca.pem"),
        ("FELIX_TOKENS_FILE", "/etc/felix/tokens"),
        (
            "FELIX_RULES",
            "alice publish,subscribe orders.*; # ops\nops admin *\n;bob subscribe x",
        ),
    ])
    .expect("load");
    assert_eq!(
        config.auth_summary(),
        "auth: required, client certificates: /etc/felix/clients-ca.pem, tokens: \
         /etc/felix/tokens, rules: 3 rules"
    );
    let config = load_env(&[("FELIX_TOKENS_FILE", "/etc/felix/tokens")]).expect("load");
    assert_eq!(
        config.auth_summary(),
        "auth: off, client certificates: not requested, tokens: /etc/felix/tokens, rules: none \
         (every principal may do everything)"
    );
    let config = load_env(&[("FELIX_RULES", "* subscribe *")]).expect("load");
    assert!(
        config.auth_summary().ends_with("rules: 1 rule"),
        "{}",
        config.auth_summary()
    );
}

#[test]
fn tokens_file_reloads_on_sighup_in_the_reference() {
    // The reference says FELIX_TOKENS_FILE needs no restart but is re-read on SIGHUP.
    let reference = reference_markdown();
    let row = reference
        .lines()
        .find(|line| line.starts_with("| `FELIX_TOKENS_FILE` |"))
        .expect("tokens file row");
    assert!(row.contains("| no: re-read on SIGHUP |"), "{row}");
}

#[test]
fn shards_that_do_not_fit_a_frame_are_refused_naming_both() {
    // A shard bound whose stream description could not fit a frame is refused naming both
    // settings, their sources and the bytes needed; the largest fitting count is accepted.
    let frame = "64KiB";
    let error = load_env(&[
        ("FELIX_MAX_FRAME_BYTES", frame),
        ("FELIX_MAX_PAYLOAD_BYTES", frame),
        ("FELIX_MAX_SHARDS_PER_STREAM", "4096"),
    ])
    .expect_err("4096 shards in 64 KiB frames");
    assert!(
        matches!(
            &error,
            ConfigError::ShardsExceedFrame {
                shards: 4096,
                frame: 65_536,
                needed: 90_383,
                shards_origin: Source::Env(_),
                frame_origin: Source::Env(_),
            }
        ),
        "{error:?}"
    );
    assert!(
        error.to_string().starts_with(
            "FELIX_MAX_SHARDS_PER_STREAM=4096 (from environment) does not fit \
             FELIX_MAX_FRAME_BYTES=64KiB (from environment)"
        ),
        "{error}"
    );
    let fitting = (65_536 - 16 - 255) / 22;
    let config = load_env(&[
        ("FELIX_MAX_FRAME_BYTES", frame),
        ("FELIX_MAX_PAYLOAD_BYTES", frame),
        ("FELIX_MAX_SHARDS_PER_STREAM", &fitting.to_string()),
    ])
    .expect("the largest count that fits");
    assert!(crate::stream_info_bytes_max(config.max_shards_per_stream) <= 65_536);
}
