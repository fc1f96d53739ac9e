//! `felix tune` and `felix preflight` as a user runs them. What they find depends on the
//! machine, so these check the shape of the output and the exit codes' meaning, not values;
//! the tuners' exact behaviour is tested against in-memory trees in felix-tuning.

use std::process::Command;

fn felix(args: &[&str]) -> std::process::Output {
    let data = tempfile::tempdir().expect("tempdir");
    Command::new(env!("CARGO_BIN_EXE_felix"))
        .args(args)
        .env("FELIX_DATA_DIR", data.path())
        .env_remove("FELIX_HOST_PROFILE")
        .env_remove("FELIX_CONFIG")
        .output()
        .expect("felix runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

#[test]
fn tune_script_renders_each_profile() {
    for profile in ["azure", "baremetal", "test"] {
        let output = felix(&["tune", "--script", "--profile", profile]);
        assert!(output.status.success(), "{profile}: {output:?}");
        let script = text(&output.stdout);
        assert!(script.starts_with("#!/bin/sh\n"), "{script}");
        assert!(
            script.contains(&format!("for the {profile} profile")),
            "{script}"
        );
        assert!(script.contains("felix_sysctl net.core.rmem_max at-least 26214400\n"));
        assert!(script.contains("# upgrades: automatic package upgrades masked\n"));
        // Only azure and test set the NIC's MTU.
        assert_eq!(
            script.contains("# mtu:"),
            profile != "baremetal",
            "{profile}"
        );
    }
}

#[test]
fn tune_script_follows_the_configured_udp_buffers() {
    let data = tempfile::tempdir().expect("tempdir");
    let output = Command::new(env!("CARGO_BIN_EXE_felix"))
        .args(["tune", "--script"])
        .env("FELIX_DATA_DIR", data.path())
        .env("FELIX_UDP_RECV_BUFFER", "67108864")
        .output()
        .expect("felix runs");
    assert!(output.status.success(), "{output:?}");
    assert!(text(&output.stdout).contains("felix_sysctl net.core.rmem_max at-least 67108864\n"));
}

#[test]
fn tune_check_prints_a_table_and_exits_by_the_required_settings() {
    let output = felix(&["tune", "--check"]);
    let stdout = text(&output.stdout);
    let mut lines = stdout.lines();
    let header: Vec<&str> = lines.next().expect("a header").split_whitespace().collect();
    assert_eq!(
        header,
        ["SETTING", "CURRENT", "REQUIRED", "SEVERITY", "STATUS"]
    );
    assert!(stdout.contains("\nnet.core.rmem_max "), "{stdout}");
    // Exit 0 exactly when the summary says every required setting is on.
    let all_on = stdout.contains("profile baremetal: every required setting is on");
    let some_off = stdout.contains("required setting(s) off; `felix tune --apply`");
    assert!(all_on != some_off, "{stdout}");
    assert_eq!(output.status.success(), all_on, "{output:?}");
    if some_off {
        assert!(text(&output.stderr).contains("a required host setting is off"));
    }
}

#[test]
fn a_bad_profile_stops_the_command_naming_the_setting() {
    let output = felix(&["tune", "--profile", "cloud"]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("FELIX_HOST_PROFILE"), "{stderr}");
    assert!(stderr.contains("cloud"), "{stderr}");
}

#[test]
fn preflight_prints_one_line_per_check_and_json_on_request() {
    let output = felix(&["preflight", "--no-disk-probe"]);
    let stdout = text(&output.stdout);
    let labels = ["PASS ", "WARN ", "FAIL ", "SKIP "];
    assert!(!stdout.is_empty());
    for line in stdout.lines() {
        assert!(labels.iter().any(|l| line.starts_with(l)), "{line}");
    }
    assert!(stdout.contains("free space "), "{stdout}");
    assert!(stdout.contains("data volume "), "{stdout}");
    // Non-zero exactly when a line failed.
    let failed = stdout.lines().any(|l| l.starts_with("FAIL "));
    assert_eq!(output.status.success(), !failed, "{output:?}");

    let output = felix(&["preflight", "--no-disk-probe", "--json"]);
    let json = text(&output.stdout);
    assert!(json.starts_with("[{\"name\":"), "{json}");
    assert!(json.trim_end().ends_with("}]"), "{json}");
    assert_eq!(
        json.matches("\"outcome\":").count(),
        stdout.lines().count(),
        "{json}"
    );
}
