//! Every default the docs state for a FELIX_* setting agrees with the settings table
//! (tuning/src/settings.rs): README.md and docs/**/*.md, in tables with a default column, in
//! `felix config` output samples and in prose such as "FELIX_X (default 512)",
//! "`FELIX_MAX_STREAMS` (1,024)" or "FELIX_X, 4 MiB by default". Values are read the
//! way the settings read them (`Config::load` parses the doc's value through the setting's own
//! kind and renders it, so `64 MiB`, `67108864` and `64MiB` agree) after the docs' spelling is
//! undone: thousands separators, `ms` / `s` on millisecond and second settings, `on` / `off`
//! for booleans, `unset`. The wire protocol's section 6 defaults table is checked against the
//! settings the broker announces in `HelloOk` (dataplane/broker/src/settings.rs `limits`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use felix_tuning::{Config, parse_byte_size, reference_markdown};
use regex::Regex;

/// The repository root (this crate is `tuning/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tuning/ has a parent")
        .to_path_buf()
}

/// Every Markdown file that may state a default: README.md, docs/*.md, docs/design/*.md,
/// docs/grafana/*.md.
fn doc_files() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md")];
    for dir in ["docs", "docs/design", "docs/grafana"] {
        let mut found: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|error| panic!("read {dir}: {error}"))
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
            .collect();
        found.sort();
        files.extend(found);
    }
    files
}

/// The wire protocol's announced limits (docs/wire-protocol.md section 6) and the setting
/// each comes from; `max_name_bytes` is fixed by the protocol (255, no setting), checked
/// against the broker's `HelloOk` by dataplane/felix/tests/doc_limits.rs.
const WIRE_LIMITS: &[(&str, Option<&str>)] = &[
    ("max_frame_bytes", Some("FELIX_MAX_FRAME_BYTES")),
    ("max_batch_records", Some("FELIX_MAX_BATCH_RECORDS")),
    ("max_payload_bytes", Some("FELIX_MAX_PAYLOAD_BYTES")),
    ("max_key_bytes", Some("FELIX_MAX_KEY_BYTES")),
    ("max_name_bytes", None),
    ("max_shards", Some("FELIX_MAX_SHARDS_PER_STREAM")),
];

/// Settings whose shown value is computed from other settings when left at the default (the
/// data directory from HOME / XDG_DATA_HOME, the client's CA from the data directory): a doc
/// showing one for a particular machine states no default of its own.
const RENDERED_FROM_OTHERS: &[&str] = &["FELIX_DATA_DIR", "FELIX_CA"];

/// Fewest defaults each file is expected to state, so that a parser grown too strict (one
/// that matches nothing) fails instead of passing quietly.
const EXPECTED_AT_LEAST: &[(&str, usize)] = &[
    ("docs/configuration.md", 60),
    ("docs/security.md", 14),
    ("docs/operations.md", 12),
    ("docs/semantics.md", 9),
    ("docs/wire-protocol.md", 6),
    ("docs/cluster.md", 3),
    ("docs/design/per-core.md", 4),
    ("docs/storage-format.md", 2),
    ("docs/reliability.md", 1),
    ("docs/grafana/README.md", 1),
];

/// One default a doc states.
#[derive(Debug, Clone)]
struct Stated {
    file: String,
    line: usize,
    /// The setting, or several whose values the doc adds up (`A` + `B` (48 MiB)).
    settings: Vec<String>,
    /// The value as the doc writes it.
    value: String,
    /// How it was found (for the listing).
    form: &'static str,
}

/// The settings table's default of every setting, as `felix config --reference` gives it:
/// `Some(raw)` (empty: unset) or `None` when it is derived from the environment.
fn table_defaults() -> BTreeMap<String, Option<String>> {
    let row =
        Regex::new(r"^\| `(FELIX_[A-Z0-9_]+)` \| `[a-z0-9_]+` \| ([^|]*) \|").expect("row pattern");
    let mut defaults = BTreeMap::new();
    for line in reference_markdown().lines() {
        if let Some(caps) = row.captures(line) {
            let cell = caps[2].trim();
            // `unset`, a backticked value, or (FELIX_DATA_DIR) a description: derived.
            let default = if cell == "unset" {
                Some(String::new())
            } else {
                cell.strip_prefix('`')
                    .and_then(|c| c.strip_suffix('`'))
                    .map(str::to_owned)
            };
            defaults.insert(caps[1].to_owned(), default);
        }
    }
    assert!(
        defaults.len() >= 60,
        "the reference lists {} settings",
        defaults.len()
    );
    defaults
}

/// The value `raw` of `setting` as `felix config` would show it, parsed by the setting's own
/// kind; `Err` with the loader's message when the setting refuses it.
fn shown(setting: &str, raw: &str) -> Result<String, String> {
    let config = Config::load(None, vec![(setting.to_owned(), raw.to_owned())], &[])
        .map_err(|error| error.to_string())?;
    config
        .entries()
        .into_iter()
        .find(|entry| entry.env == setting)
        .map(|entry| entry.value)
        .ok_or_else(|| format!("no entry for {setting}"))
}

/// The doc's spelling of a value undone for `setting`: backticks, thousands separators, time
/// units on `_MS` / `_SECONDS` settings, byte units (kept: the size parser reads `64 MiB`),
/// `on` / `off` for booleans, `unset`. `None` when the text is no value the setting could
/// have (a unit that does not fit it).
fn spelled(setting: &str, text: &str) -> Option<Vec<String>> {
    let text = text.trim().trim_matches('`').trim();
    match text {
        "unset" | "(unset)" | "none" => return Some(vec![String::new()]),
        // `off` is a value of its own for some settings (FELIX_AUTH, FELIX_METRICS_BIND) and
        // the docs' word for 0 for booleans: both readings are tried.
        "off" => return Some(vec!["off".to_owned(), "0".to_owned()]),
        "on" => return Some(vec!["on".to_owned(), "1".to_owned()]),
        _ => {}
    }
    let number = Regex::new(r"^(\d{1,3}(?:,\d{3})+|\d+)(?:\s*([A-Za-z]+))?$").expect("number");
    let Some(caps) = number.captures(text) else {
        return Some(vec![text.to_owned()]);
    };
    let digits = caps[1].replace(',', "");
    let unit = caps.get(2).map_or("", |unit| unit.as_str());
    let value = match unit {
        "" | "B" | "bytes" | "records" | "jobs" | "entries" | "batches" => digits,
        "KiB" | "MiB" | "GiB" | "TiB" => format!("{digits}{unit}"),
        "ms" if setting.ends_with("_MS") => digits,
        "s" | "seconds" if setting.ends_with("_MS") => {
            (digits.parse::<u64>().ok()? * 1000).to_string()
        }
        "s" | "seconds" if setting.ends_with("_SECONDS") => digits,
        _ => return None,
    };
    Some(vec![value])
}

/// The text of `path` relative to the repository root, for messages.
fn relative(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Line number (from 1) of byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].bytes().filter(|b| *b == b'\n').count() + 1
}

/// A value as the docs write one: a backticked word, a number with an optional unit, or one
/// of a few words.
const VALUE: &str = r"(`[^`]+`|\d{1,3}(?:,\d{3})+(?:\s?(?:KiB|MiB|GiB|TiB|ms|s)\b)?|\d+(?:\s?(?:KiB|MiB|GiB|TiB|ms|s)\b)?|\bon\b|\boff\b|\bunset\b)";

struct Patterns {
    name: Regex,
    /// Right after the name (and a few words): `(VALUE)`, `(default VALUE)`, `(VALUE by
    /// default)`, `(VALUE; ...)`, `(VALUE, ...)`.
    paren: Regex,
    /// In the clause after the name: `default VALUE`, `default is VALUE`, `defaults to VALUE`,
    /// `VALUE by default`.
    clause: Regex,
    /// Just before the name: `default VALUE [noun] (NAME`, `default VALUE, the broker's
    /// default NAME`.
    before: Regex,
    /// A `felix config` output line: `NAME  VALUE  default`.
    config_line: Regex,
}

impl Patterns {
    fn new() -> Patterns {
        let regex = |pattern: String| Regex::new(&pattern).expect("pattern");
        Patterns {
            name: regex(r"FELIX_[A-Z0-9_]*[A-Z0-9]".to_owned()),
            // A few words may come between (`FELIX_X jobs (512)`), unless the name closed a
            // parenthesis of its own: `(FELIX_A) and shards (FELIX_B)` states nothing.
            paren: regex(format!(
                r"^`?(?:\s*(?:[A-Za-z]+\s+){{0,4}}|\)`?\s*)\(\s*(?:default:?\s+)?{VALUE}\s*(?:by default\s*)?[);,=]"
            )),
            clause: regex(format!(
                r"\bdefault(?:s to| is)?:?\s+{VALUE}|{VALUE}\s+by default\b"
            )),
            before: regex(format!(
                r"\bdefault\s+{VALUE}(?:(?:\s+[a-z]+)?\s*\(?|,?\s+(?:the|like the)\s+broker's(?:\s+default)?\s*)`?$"
            )),
            config_line: regex(r"^(FELIX_[A-Z0-9_]+)\s{2,}(\S+)\s{2,}default\s*$".to_owned()),
        }
    }
}

/// Whether a matched value can be a setting's value: not another setting's name, not a Rust
/// path (`ClientConfig::pub_shard_streams`).
fn is_value(text: &str) -> bool {
    !text.contains("FELIX_") && !text.contains("::")
}

/// The clause around a name ends at a sentence, table cell or clause end, or another name.
fn clause_end(text: &str) -> usize {
    let mut end = text.len().min(120);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    for stop in [". ", ".\n", "|", ";", "FELIX_"] {
        if let Some(at) = text[..end].find(stop) {
            end = at;
        }
    }
    end
}

/// Parenthesised asides dropped from a clause (`both 0 (keep everything) by default`).
fn without_asides(text: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' if depth > 0 => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// Every default stated in `text` (one file).
fn stated_in(file: &str, text: &str, patterns: &Patterns) -> Vec<Stated> {
    let mut found: Vec<Stated> = Vec::new();
    let mut seen: BTreeSet<(usize, String)> = BTreeSet::new();
    let mut push = |stated: Stated, found: &mut Vec<Stated>| {
        if seen.insert((stated.line, stated.settings.join("+"))) {
            found.push(stated);
        }
    };

    // Tables with a `default` column, and `felix config` samples, line by line.
    let lines: Vec<&str> = text.lines().collect();
    let mut in_fence = false;
    let mut default_column: Option<usize> = None;
    for (index, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            if let Some(caps) = patterns.config_line.captures(line) {
                push(
                    Stated {
                        file: file.to_owned(),
                        line: index + 1,
                        settings: vec![caps[1].to_owned()],
                        value: caps[2].to_owned(),
                        form: "felix config sample",
                    },
                    &mut found,
                );
            }
            continue;
        }
        if !line.trim_start().starts_with('|') {
            default_column = None;
            continue;
        }
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
        let is_rule = cells
            .iter()
            .all(|cell| cell.trim().chars().all(|c| matches!(c, '-' | ':')));
        if is_rule {
            continue;
        }
        let next_is_rule = lines
            .get(index + 1)
            .is_some_and(|next| next.trim().starts_with("|-") || next.trim().starts_with("|:"));
        if next_is_rule {
            // A header row: where is its `default` column, if any?
            default_column = cells
                .iter()
                .position(|cell| cell.trim().eq_ignore_ascii_case("default"));
            continue;
        }
        let Some(column) = default_column else {
            continue;
        };
        let (Some(key), Some(cell)) = (cells.first(), cells.get(column)) else {
            continue;
        };
        let key = key.trim().trim_matches('`');
        let setting = if patterns
            .name
            .find(key)
            .is_some_and(|name| name.as_str() == key)
        {
            Some(key.to_owned())
        } else {
            WIRE_LIMITS
                .iter()
                .find(|(limit, _)| *limit == key)
                .map(|(limit, setting)| setting.map_or_else(|| (*limit).to_owned(), str::to_owned))
        };
        let Some(setting) = setting else {
            continue;
        };
        let value = Regex::new(&format!(r"^\s*{VALUE}"))
            .expect("value")
            .captures(cell)
            .map(|caps| caps[1].to_owned())
            .unwrap_or_else(|| cell.trim().to_owned());
        push(
            Stated {
                file: file.to_owned(),
                line: index + 1,
                settings: vec![setting],
                value,
                form: "table",
            },
            &mut found,
        );
    }

    // Prose: the text with line breaks as spaces (the same byte offsets), so a statement
    // wrapped over two lines is still one.
    let flat = text.replace('\n', " ");
    let names: Vec<regex::Match<'_>> = patterns.name.find_iter(&flat).collect();
    for (index, name) in names.iter().enumerate() {
        let line = line_of(text, name.start());
        if lines
            .get(line - 1)
            .is_some_and(|l| patterns.config_line.is_match(l))
        {
            continue;
        }
        let after = &flat[name.end()..];
        let stated = |settings: Vec<String>, value: &str, form| Stated {
            file: file.to_owned(),
            line,
            settings,
            value: value.to_owned(),
            form,
        };
        // `A` + `B` (48 MiB): the doc states the sum.
        let summed = index > 0 && {
            let between = &flat[names[index - 1].end()..name.start()];
            between.trim_matches(|c: char| c == '`' || c.is_whitespace()) == "+"
        };
        if let Some(caps) = patterns
            .paren
            .captures(after)
            .filter(|caps| is_value(&caps[1]))
        {
            let settings = if summed {
                vec![
                    names[index - 1].as_str().to_owned(),
                    name.as_str().to_owned(),
                ]
            } else {
                vec![name.as_str().to_owned()]
            };
            push(
                stated(settings, &caps[1], "(value) after the name"),
                &mut found,
            );
            continue;
        }
        // The clause as written, then without its asides (`both 0 (keep everything) by
        // default`); a default of another subject (`s2n-quic's client default is 1500`, `where
        // ...`) is not this setting's.
        let clause = &after[..clause_end(after)];
        let in_clause = [clause.to_owned(), without_asides(clause)]
            .into_iter()
            .find_map(|clause| {
                let caps = patterns.clause.captures(&clause)?;
                let whole = caps.get(0)?;
                let lead = &clause[..whole.start()];
                if ["'s ", " where ", " unlike ", " than "]
                    .iter()
                    .any(|other| lead.contains(other))
                {
                    return None;
                }
                let value = caps.get(1).or_else(|| caps.get(2))?.as_str().to_owned();
                is_value(&value).then_some(value)
            });
        if let Some(value) = in_clause {
            push(
                stated(
                    vec![name.as_str().to_owned()],
                    &value,
                    "default in the clause",
                ),
                &mut found,
            );
            continue;
        }
        let start = name.start().saturating_sub(60);
        let start = (start..name.start())
            .find(|at| flat.is_char_boundary(*at))
            .unwrap_or(name.start());
        let before = &flat[start..name.start()];
        let before = before
            .rfind(['|', '.', ';'])
            .map_or(before, |at| &before[at + 1..]);
        if let Some(caps) = patterns.before.captures(before) {
            push(
                stated(
                    vec![name.as_str().to_owned()],
                    &caps[1],
                    "default before the name",
                ),
                &mut found,
            );
        } else if clause.contains("default") || before.contains("default") {
            // Listed for a reader of the test's output: a mention of a default in a form
            // the finder does not read (derived text such as "the default route's
            // interface", or a new form worth teaching it).
            println!(
                "{file}:{line}: not read as a default: ...{}{}...",
                before.trim_start(),
                &after[..clause_end(after)]
            );
        }
    }
    found
}

/// Why `stated` disagrees with the settings table, or `None` when it agrees.
fn disagreement(stated: &Stated, defaults: &BTreeMap<String, Option<String>>) -> Option<String> {
    let real = |setting: &str| -> Result<String, String> {
        match defaults.get(setting) {
            None => Err(format!("{setting} is no setting")),
            Some(None) => Err(format!("{setting}'s default is derived")),
            Some(Some(raw)) => shown(setting, raw),
        }
    };
    if let [first, second] = stated.settings.as_slice() {
        // A sum of two byte sizes.
        let size = |setting: &str| real(setting).ok().and_then(|shown| parse_byte_size(&shown));
        let stated_bytes = spelled(first, &stated.value)
            .and_then(|values| values.into_iter().next())
            .and_then(|value| parse_byte_size(&value));
        return match (size(first), size(second), stated_bytes) {
            (Some(a), Some(b), Some(doc)) if a + b == doc => None,
            (a, b, _) => Some(format!(
                "states {first} + {second} = {}, the defaults add up to {:?} + {:?} bytes",
                stated.value, a, b
            )),
        };
    }
    let setting = &stated.settings[0];
    let expected = match real(setting) {
        Ok(expected) => expected,
        Err(why) => return Some(why),
    };
    let Some(candidates) = spelled(setting, &stated.value) else {
        return Some(format!(
            "states {setting} = {} (a unit {setting} does not take), the default is {expected}",
            stated.value
        ));
    };
    let mut last = String::new();
    for candidate in candidates {
        match shown(setting, &candidate) {
            Ok(value) if value == expected => return None,
            Ok(value) => last = value,
            Err(error) => last = format!("(refused: {error})"),
        }
    }
    Some(format!(
        "states {setting} = {} (read as {last}), the default is {expected}",
        stated.value
    ))
}

// Proves every default the docs state agrees with the settings table, and that the parser finds
// a reasonable number of them in each file that states defaults.
#[test]
fn every_default_the_docs_state_is_the_settings_tables() {
    let defaults = table_defaults();
    let patterns = Patterns::new();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut wire_rows = BTreeSet::new();
    for path in doc_files() {
        let file = relative(&path);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{file}: {error}"));
        for stated in stated_in(&file, &text, &patterns) {
            if let Some((limit, _)) = WIRE_LIMITS
                .iter()
                .find(|(limit, setting)| {
                    stated.settings[0] == setting.unwrap_or(*limit)
                        && file == "docs/wire-protocol.md"
                })
                .filter(|_| stated.form == "table")
            {
                wire_rows.insert(*limit);
            }
            if stated.settings[0] == "max_name_bytes" {
                // Fixed by the protocol: dataplane/felix/tests/doc_limits.rs checks it.
                continue;
            }
            if stated
                .settings
                .iter()
                .any(|setting| RENDERED_FROM_OTHERS.contains(&setting.as_str()))
            {
                continue;
            }
            if !stated.settings.iter().all(|s| defaults.contains_key(s)) {
                // Not a setting of the table (appliance-image variables, `FELIX_DURABLE_*`
                // families written with a star): nothing to compare.
                continue;
            }
            *counts.entry(file.clone()).or_default() += 1;
            let verdict = disagreement(&stated, &defaults);
            println!(
                "{}:{}: {} = {} [{}]{}",
                stated.file,
                stated.line,
                stated.settings.join(" + "),
                stated.value,
                stated.form,
                verdict
                    .as_deref()
                    .map_or(String::new(), |why| format!("  <-- {why}"))
            );
            if let Some(why) = verdict {
                failures.push(format!("{}:{}: {why}", stated.file, stated.line));
            }
        }
    }
    println!("stated defaults per file: {counts:?}");
    for (file, least) in EXPECTED_AT_LEAST {
        let found = counts.get(*file).copied().unwrap_or(0);
        assert!(
            found >= *least,
            "found only {found} stated defaults in {file} (expected at least {least}): the parser \
             no longer reads its statements"
        );
    }
    let wanted: BTreeSet<&str> = WIRE_LIMITS.iter().map(|(limit, _)| *limit).collect();
    assert_eq!(
        wire_rows, wanted,
        "docs/wire-protocol.md section 6 lists every announced limit with its default"
    );
    assert!(
        failures.is_empty(),
        "docs disagree with the settings table (tuning/src/settings.rs):\n{}",
        failures.join("\n")
    );
}

// Proves the reader of stated values: thousands separators, units and words undone as the
// settings' own parsers would read them, and a wrong value refused.
#[test]
fn stated_values_are_read_like_settings() {
    let defaults = table_defaults();
    let stated = |setting: &str, value: &str| Stated {
        file: "test".to_owned(),
        line: 1,
        settings: vec![setting.to_owned()],
        value: value.to_owned(),
        form: "test",
    };
    for (setting, value) in [
        ("FELIX_MAX_SHARDS_PER_STREAM", "1,024"),
        ("FELIX_MAX_FRAME_BYTES", "16,777,216"),
        ("FELIX_MAX_FRAME_BYTES", "16 MiB"),
        ("FELIX_MAX_FRAME_BYTES", "`16MiB`"),
        ("FELIX_HELLO_TIMEOUT_MS", "10 s"),
        ("FELIX_HELLO_TIMEOUT_MS", "10,000"),
        ("FELIX_DURABLE_FSYNC_INTERVAL_MS", "250 ms"),
        ("FELIX_STORAGE_DIRECT_IO", "on"),
        ("FELIX_AUTH", "`off`"),
        ("FELIX_TLS_CERT", "unset"),
    ] {
        assert_eq!(
            disagreement(&stated(setting, value), &defaults),
            None,
            "{setting} = {value}"
        );
    }
    for (setting, value) in [
        ("FELIX_MAX_SHARDS_PER_STREAM", "4,096"),
        ("FELIX_MAX_FRAME_BYTES", "16 KiB"),
        ("FELIX_HELLO_TIMEOUT_MS", "10 ms"),
        ("FELIX_MAX_STREAMS", "1,024 s"),
        ("FELIX_STORAGE_DIRECT_IO", "off"),
    ] {
        assert!(
            disagreement(&stated(setting, value), &defaults).is_some(),
            "{setting} = {value} is refused"
        );
    }
}

// Proves the statement finder reads each form the docs use, and not a value that is no default.
#[test]
fn statement_forms_are_found() {
    let patterns = Patterns::new();
    let text = "\
| setting | default | meaning |
|---|---|---|
| `FELIX_DURABLE_RETENTION_BYTES` | `0` (keep all) | per core |
| `FELIX_MAX_BATCH_RECORDS` (4,096), `FELIX_MAX_KEY_BYTES` (1,024) | x | y |
| `FELIX_BROKER_PUB_CONN_RECV_WINDOW` + `FELIX_MAX_FRAME_BYTES` (48 MiB) | x | y |
Each core has FELIX_INGRESS_QUEUE_DEPTH jobs (512) and up to
FELIX_PUBLISH_QUEUE_WAIT_MS (2000 ms) of waiting; FELIX_PUBLISH_INFLIGHT_BYTES, 4 MiB by
default. The ring keeps by default 1,024 records (FELIX_REPLAY_RING_MAX_RECORDS). The Raft log
(after FELIX_CLUSTER_RAFT_COMPACT_ENTRIES applied batches, 10,000 by default) and
FELIX_DURABLE_RETENTION_SECONDS, both 0 (keep everything) by default. FELIX_PUB_INGRESS_WAIT=1
waits. `FELIX_HELLO_TIMEOUT_MS` (10 s by default). FELIX_STORAGE_DIRECT_IO, default on.
FELIX_X (e.g. 5) is none. A client MTU (default 4096, the broker's default FELIX_MTU_UPPER_BOUND)
```text
FELIX_REPLAY_RING_MAX_BYTES       64MiB                            default
FELIX_LOG                         debug                            environment
```
";
    let found: Vec<(usize, String, String)> = stated_in("test", text, &patterns)
        .into_iter()
        .map(|stated| (stated.line, stated.settings.join("+"), stated.value))
        .collect();
    let expected: Vec<(usize, String, String)> = [
        (3, "FELIX_DURABLE_RETENTION_BYTES", "`0`"),
        (14, "FELIX_REPLAY_RING_MAX_BYTES", "64MiB"),
        (4, "FELIX_MAX_BATCH_RECORDS", "4,096"),
        (4, "FELIX_MAX_KEY_BYTES", "1,024"),
        (
            5,
            "FELIX_BROKER_PUB_CONN_RECV_WINDOW+FELIX_MAX_FRAME_BYTES",
            "48 MiB",
        ),
        (6, "FELIX_INGRESS_QUEUE_DEPTH", "512"),
        (7, "FELIX_PUBLISH_QUEUE_WAIT_MS", "2000 ms"),
        (7, "FELIX_PUBLISH_INFLIGHT_BYTES", "4 MiB"),
        (8, "FELIX_REPLAY_RING_MAX_RECORDS", "1,024"),
        (9, "FELIX_CLUSTER_RAFT_COMPACT_ENTRIES", "10,000"),
        (10, "FELIX_DURABLE_RETENTION_SECONDS", "0"),
        (11, "FELIX_HELLO_TIMEOUT_MS", "10 s"),
        (11, "FELIX_STORAGE_DIRECT_IO", "on"),
        (12, "FELIX_MTU_UPPER_BOUND", "4096"),
    ]
    .into_iter()
    .map(|(line, settings, value)| (line, settings.to_owned(), value.to_owned()))
    .collect();
    assert_eq!(found, expected);
}
