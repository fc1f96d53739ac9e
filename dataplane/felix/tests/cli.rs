//! Conventions of an installed command-line tool: a closed pipe ends a command quietly, each
//! subcommand's help shows only its own options, completions and the man page are generated
//! from the same definitions.

use std::process::{Command, Stdio};

fn felix(args: &[&str]) -> std::process::Output {
    let data = tempfile::tempdir().expect("tempdir");
    Command::new(env!("CARGO_BIN_EXE_felix"))
        .args(args)
        .env("FELIX_DATA_DIR", data.path())
        .output()
        .expect("felix runs")
}

fn stdout(args: &[&str]) -> String {
    let output = felix(args);
    assert!(output.status.success(), "felix {args:?}: {output:?}");
    String::from_utf8(output.stdout).expect("utf-8")
}

#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    let data = tempfile::tempdir().expect("tempdir");
    // The read end is closed before felix starts, so its first write fails with EPIPE.
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_felix"))
        .arg("config")
        .env("FELIX_DATA_DIR", data.path())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("felix runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.is_empty(),
        "a closed pipe ends the command without a message: {stderr}"
    );
    // Ended by SIGPIPE, as `head` expects of any Unix tool (the shell reports 141).
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&output.status),
        Some(13),
        "{output:?}"
    );
}

#[test]
fn each_subcommand_help_shows_only_its_options() {
    let publish = stdout(&["pub", "--help"]);
    assert!(
        publish.contains("--addr") && publish.contains("--batch"),
        "{publish}"
    );
    for foreign in ["--bind", "--metrics-bind"] {
        assert!(
            !publish.contains(foreign),
            "`felix pub --help` lists {foreign}"
        );
    }
    let broker = stdout(&["broker", "--help"]);
    assert!(
        broker.contains("--bind") && broker.contains("--data-dir"),
        "{broker}"
    );
    for foreign in ["--insecure", "--addr", "--ca", "--no-core-aware"] {
        assert!(
            !broker.contains(foreign),
            "`felix broker --help` lists {foreign}"
        );
    }
    // The host commands take no network options.
    for command in [["tune", "--help"], ["preflight", "--help"]] {
        let help = stdout(&command);
        assert!(help.contains("--profile"), "{help}");
        for foreign in ["--bind", "--metrics-bind", "--addr", "--insecure"] {
            assert!(
                !help.contains(foreign),
                "`felix {}` lists {foreign}",
                command.join(" ")
            );
        }
    }
    // Client flags may follow the stream subcommand.
    let create = stdout(&["stream", "create", "--help"]);
    assert!(
        create.contains("--addr") && create.contains("--shards"),
        "{create}"
    );
}

#[test]
fn completions_and_the_man_page_come_from_the_definitions() {
    let bash = stdout(&["completions", "bash"]);
    assert!(
        bash.contains("_felix()") && bash.contains("--no-core-aware"),
        "{bash}"
    );
    let zsh = stdout(&["completions", "zsh"]);
    assert!(zsh.starts_with("#compdef felix"), "{zsh}");
    let man = stdout(&["man"]);
    assert!(man.contains(".TH felix 1"), "{man}");
    assert!(man.contains("broker"), "the man page lists the subcommands");
}
