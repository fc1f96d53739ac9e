//! `felix-hostile`: runs the hostile-client suite against a running broker and prints the
//! per-case table. Exit status 0 when every case passed, 1 when one failed, 2 on bad usage.
//!
//! ```text
//! felix-hostile --addr 127.0.0.1:7400 --ca ~/.local/share/felix/tls/dev-cert.pem \
//!     [--pid PID] [--metrics 127.0.0.1:9400] [--seed N] [--repeat N] [--case NAME]...
//!     [--max-connections-per-core N] [--max-connections-per-principal N]
//!     [--max-streams-per-connection N] [--max-subscriptions-per-connection N]
//!     [--hello-timeout-ms N] [--hello-max-bytes N] [--subscriber-queue-max-bytes N]
//! ```
//!
//! It floods the limits it is given: point it at a broker you own, on loopback.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use felix_hostile::{Options, Target, cases, run_suite};

const USAGE: &str = "usage: felix-hostile --addr IP:PORT --ca FILE [--server-name NAME] \
[--core-addr IP:PORT]... [--pid PID] [--metrics IP:PORT] [--seed N] [--repeat N] \
[--case NAME]... [--known-failure NAME]... [--max-connections-per-core N] \
[--max-connections-per-principal N] [--max-streams-per-connection N] \
[--max-subscriptions-per-connection N] [--hello-timeout-ms N] [--hello-max-bytes N] \
[--subscriber-queue-max-bytes N] [--quiet] [--list]";

fn main() -> ExitCode {
    match parse(std::env::args().skip(1).collect()) {
        Ok(Command::List) => {
            for case in cases() {
                println!("{}", case.name);
            }
            ExitCode::SUCCESS
        }
        Ok(Command::Run(run_with)) => run(&run_with.0, &run_with.1),
        Err(error) => {
            eprintln!("felix-hostile: {error}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run(target: &Target, options: &Options) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("felix-hostile: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let report = runtime.block_on(run_suite(target, options));
    println!("{report}");
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

enum Command {
    List,
    Run(Box<(Target, Options)>),
}

fn parse(args: Vec<String>) -> Result<Command, String> {
    let mut addr: Option<SocketAddr> = None;
    let mut ca: Option<PathBuf> = None;
    let mut target = Target::new(SocketAddr::from(([127, 0, 0, 1], 7400)), PathBuf::new());
    let mut options = Options {
        verbose: true,
        ..Options::default()
    };
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--list" => return Ok(Command::List),
            "--quiet" => options.verbose = false,
            "--addr" => addr = Some(number(&flag, &value()?)?),
            "--ca" => ca = Some(PathBuf::from(value()?)),
            "--server-name" => target.server_name = value()?,
            "--core-addr" => target.core_addrs.push(number(&flag, &value()?)?),
            "--pid" => target.pid = Some(number(&flag, &value()?)?),
            "--metrics" => target.metrics_addr = Some(number(&flag, &value()?)?),
            "--seed" => options.seed = number(&flag, &value()?)?,
            "--repeat" => options.repeat = number(&flag, &value()?)?,
            "--case" => options.only.push(value()?),
            "--known-failure" => options.known_failures.push(value()?),
            "--max-connections-per-core" => {
                target.limits.connections_per_core = Some(number(&flag, &value()?)?);
            }
            "--max-connections-per-principal" => {
                target.limits.connections_per_principal = Some(number(&flag, &value()?)?);
            }
            "--max-streams-per-connection" => {
                target.limits.streams_per_connection = Some(number(&flag, &value()?)?);
            }
            "--max-subscriptions-per-connection" => {
                target.limits.subscriptions_per_connection = Some(number(&flag, &value()?)?);
            }
            "--hello-timeout-ms" => {
                target.limits.hello_timeout =
                    Some(Duration::from_millis(number(&flag, &value()?)?));
            }
            "--hello-max-bytes" => {
                target.limits.hello_max_bytes = Some(number(&flag, &value()?)?);
            }
            "--subscriber-queue-max-bytes" => {
                target.limits.subscriber_queue_max_bytes = Some(number(&flag, &value()?)?);
            }
            "-h" | "--help" => return Err("help".to_owned()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    target.quic_addr = addr.ok_or("--addr is required")?;
    target.ca_pem = ca.ok_or("--ca is required")?;
    Ok(Command::Run(Box::new((target, options))))
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    text.parse()
        .map_err(|error| format!("{flag} {text:?}: {error}"))
}
