//! The `felix` binary: the broker (`felix broker`) and the command-line client (`stream`,
//! `pub`, `sub`), plus `config`, `cert`, `tune` and `preflight`. Configuration comes from felix-tuning (defaults <
//! file < FELIX_* environment < these flags); a bad value stops any command with a message
//! naming the variable.
//!
//! Threads: `felix broker` runs the broker's core and metrics threads (see felix-broker) and a
//! signal thread; client commands run a current-thread tokio runtime on the main thread.

mod client_commands;
mod cluster_commands;
mod host_commands;
mod listener_sweep;
mod log_commands;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, CommandFactory as _, Parser, Subcommand};
use felix_broker::Broker;
use felix_tuning::Config;

#[derive(Debug, Parser)]
#[command(
    name = "felix",
    version,
    about = "Felix: a QUIC publish/subscribe broker and its command-line client"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options of every command; each maps onto a FELIX_* setting (flags win over the environment
/// and the config file).
#[derive(Debug, Args)]
struct CommonArgs {
    /// Config file (TOML); default: FELIX_CONFIG, else none.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log filter, e.g. `info` or `felix_broker=debug` (FELIX_LOG).
    #[arg(long, global = true, value_name = "FILTER")]
    log: Option<String>,
}

/// Options of the broker (and of `felix config`, which shows what a broker would use).
#[derive(Debug, Args)]
struct BrokerArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Data directory (FELIX_DATA_DIR).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<String>,
    /// QUIC listen address (FELIX_BIND).
    #[arg(long, value_name = "IP:PORT")]
    bind: Option<String>,
    /// Metrics listen address, or `off` (FELIX_METRICS_BIND).
    #[arg(long, value_name = "IP:PORT|off")]
    metrics_bind: Option<String>,
}

/// Options of `felix preflight`: the settings it reads, and the data directory it checks.
#[derive(Debug, Args)]
struct HostArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Data directory (FELIX_DATA_DIR).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<String>,
}

/// Options of the client commands (`stream`, `pub`, `sub`).
#[derive(Debug, Args)]
struct ClientArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Broker address (FELIX_ADDR).
    #[arg(long, global = true, value_name = "IP:PORT")]
    addr: Option<String>,
    /// CA certificate (PEM) to trust (FELIX_CA); default: the development certificate in the
    /// data directory.
    #[arg(long, global = true, value_name = "FILE")]
    ca: Option<String>,
    /// Skip broker certificate verification: development only (FELIX_INSECURE=1).
    #[arg(long, global = true)]
    insecure: bool,
    /// Data directory whose development certificate to trust (FELIX_DATA_DIR).
    #[arg(long, global = true, value_name = "DIR")]
    data_dir: Option<String>,
    /// Send everything through FELIX_ADDR instead of straight to each shard's owner core
    /// (the broker then hops between cores).
    #[arg(long, global = true)]
    no_core_aware: bool,
    /// Bearer token to authenticate with (FELIX_TOKEN). Other users can read a command line
    /// in the process list: prefer FELIX_TOKEN in the environment or the config file.
    #[arg(long, global = true, value_name = "TOKEN")]
    token: Option<String>,
    /// Client certificate chain (PEM) for mutual TLS (FELIX_CLIENT_CERT); with --client-key.
    #[arg(long, global = true, value_name = "FILE")]
    client_cert: Option<String>,
    /// Private key of --client-cert (FELIX_CLIENT_KEY).
    #[arg(long, global = true, value_name = "FILE")]
    client_key: Option<String>,
}

/// The flags as (setting name, raw value) pairs for felix-tuning.
#[derive(Default)]
struct Flags(Vec<(&'static str, String)>);

impl Flags {
    fn push(&mut self, name: &'static str, value: Option<&String>) {
        if let Some(value) = value {
            self.0.push((name, value.clone()));
        }
    }

    fn common(&mut self, args: &CommonArgs) -> Option<PathBuf> {
        self.push("FELIX_LOG", args.log.as_ref());
        args.config.clone()
    }

    fn broker(&mut self, args: &BrokerArgs) -> Option<PathBuf> {
        self.push("FELIX_DATA_DIR", args.data_dir.as_ref());
        self.push("FELIX_BIND", args.bind.as_ref());
        self.push("FELIX_METRICS_BIND", args.metrics_bind.as_ref());
        self.common(&args.common)
    }

    fn client(&mut self, args: &ClientArgs) -> Option<PathBuf> {
        self.push("FELIX_ADDR", args.addr.as_ref());
        self.push("FELIX_CA", args.ca.as_ref());
        self.push("FELIX_DATA_DIR", args.data_dir.as_ref());
        self.push("FELIX_TOKEN", args.token.as_ref());
        self.push("FELIX_CLIENT_CERT", args.client_cert.as_ref());
        self.push("FELIX_CLIENT_KEY", args.client_key.as_ref());
        if args.insecure {
            self.0.push(("FELIX_INSECURE", "1".to_owned()));
        }
        let _ = client_commands::NO_CORE_AWARE.set(args.no_core_aware);
        self.common(&args.common)
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a broker (defaults: loopback, the data directory, a development certificate).
    Broker(BrokerArgs),
    /// Create, list, describe or delete streams.
    Stream {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: StreamCommand,
    },
    /// Publish records: the arguments, else one record per stdin line.
    Pub {
        #[command(flatten)]
        client: ClientArgs,
        #[command(flatten)]
        args: client_commands::PubArgs,
    },
    /// Print a stream's records, one per line.
    Sub {
        #[command(flatten)]
        client: ClientArgs,
        #[command(flatten)]
        args: client_commands::SubArgs,
    },
    /// Print every effective setting and where it came from.
    Config {
        #[command(flatten)]
        broker: BrokerArgs,
        /// Print the full settings reference (Markdown) instead.
        #[arg(long)]
        reference: bool,
    },
    /// Generate a self-signed certificate and key (PEM) for development.
    Cert {
        /// Folder to write cert.pem and key.pem into (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Host names / IP addresses the certificate is valid for (repeatable);
        /// default localhost, 127.0.0.1, ::1.
        #[arg(long = "name", value_name = "HOST")]
        names: Vec<String>,
        /// Overwrite existing files.
        #[arg(long)]
        force: bool,
    },
    /// Check the host against its profile (the default), apply the profile, or print it as a
    /// shell script; `felix tune listeners` sweeps FELIX_QUIC_LISTENERS.
    #[command(args_conflicts_with_subcommands = true)]
    Tune {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        args: host_commands::TuneArgs,
        #[command(subcommand)]
        command: Option<TuneCommand>,
    },
    /// The checks a node must pass before taking load; exits non-zero when one fails.
    Preflight {
        #[command(flatten)]
        host: HostArgs,
        #[command(flatten)]
        args: host_commands::PreflightArgs,
    },
    /// Offline maintenance of the durable logs (stop the broker first): check, repair,
    /// compact.
    Log {
        #[command(flatten)]
        common: CommonArgs,
        /// Data directory (FELIX_DATA_DIR).
        #[arg(long, global = true, value_name = "DIR")]
        data_dir: Option<String>,
        #[command(subcommand)]
        command: log_commands::LogCommand,
    },
    /// Manage the bearer tokens of FELIX_TOKENS_FILE (the broker re-reads it on SIGHUP).
    Token {
        #[command(flatten)]
        common: CommonArgs,
        /// The tokens file (default: FELIX_TOKENS_FILE).
        #[arg(long, global = true, value_name = "FILE")]
        file: Option<PathBuf>,
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// A cluster's status (a member's metrics endpoint), its streams (over QUIC, under the
    /// broker's authentication and rules), and development peer certificates
    /// (docs/cluster.md).
    Cluster {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: cluster_commands::ClusterCommand,
    },
    /// Print a shell completion script (the package installs them).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff; the package installs it).
    Man,
}

#[derive(Debug, Subcommand)]
enum TuneCommand {
    /// Sweep FELIX_QUIC_LISTENERS over 1..=data-plane cores against a broker started on
    /// loopback with a short load; print a row per count and recommend one.
    Listeners {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        args: listener_sweep::ListenersArgs,
    },
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Create a token for PRINCIPAL: prints it once and appends its hash to the file.
    Add {
        /// Who the token authenticates as (the name rules use).
        principal: String,
    },
    /// List the tokens in the file: id and principal (the secrets are not stored).
    List,
    /// Remove the token with this id, or every token of this principal.
    Revoke {
        /// A token id (16 hex digits) or a principal.
        id_or_principal: String,
    },
}

#[derive(Debug, Subcommand)]
enum StreamCommand {
    /// Create a stream.
    Create {
        name: String,
        /// Number of shards.
        #[arg(long, default_value_t = 1)]
        shards: u32,
        /// A durable stream: records go to the per-core log and survive restarts.
        #[arg(long)]
        durable: bool,
    },
    /// List every stream.
    List,
    /// Show a stream's shards and offsets.
    Describe { name: String },
    /// Delete a stream (its subscribers are ended).
    Delete { name: String },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Broker(_)) {
        // A command whose output goes to a closed pipe (`felix config | head`) ends quietly,
        // as other Unix tools do. Rust ignores SIGPIPE, which turns that into a panic in
        // `print!`. The broker keeps ignoring it: a closed stdout must not stop it.
        // SAFETY: restoring a signal's default disposition before any thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("felix: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let mut flags = Flags::default();
    let file = match &cli.command {
        Command::Broker(args) | Command::Config { broker: args, .. } => flags.broker(args),
        Command::Tune {
            command: Some(TuneCommand::Listeners { common, .. }),
            ..
        } => flags.common(common),
        Command::Tune { common, args, .. } => {
            flags.push("FELIX_HOST_PROFILE", args.profile.as_ref());
            flags.common(common)
        }
        Command::Preflight { host, args } => {
            flags.push("FELIX_HOST_PROFILE", args.profile.as_ref());
            flags.push("FELIX_DATA_DIR", host.data_dir.as_ref());
            flags.common(&host.common)
        }
        Command::Stream { client, .. }
        | Command::Pub { client, .. }
        | Command::Sub { client, .. }
        | Command::Cluster { client, .. } => flags.client(client),
        Command::Token { common, .. } => flags.common(common),
        Command::Log {
            common, data_dir, ..
        } => {
            flags.push("FELIX_DATA_DIR", data_dir.as_ref());
            flags.common(common)
        }
        Command::Cert { .. } | Command::Completions { .. } | Command::Man => None,
    };
    match cli.command {
        Command::Completions { shell } => {
            let mut command = Cli::command();
            clap_complete::generate(shell, &mut command, "felix", &mut std::io::stdout());
            return Ok(());
        }
        Command::Man => {
            clap_mangen::Man::new(Cli::command())
                .render(&mut std::io::stdout())
                .context("cannot write the man page")?;
            return Ok(());
        }
        _ => {}
    }
    let config = Config::from_process(file.as_deref(), &flags.0)?;
    init_logging(&config)?;
    match cli.command {
        Command::Broker(_) => run_broker(&config),
        Command::Config { reference, .. } => {
            if reference {
                print!("{}", felix_tuning::reference_markdown());
            } else {
                print!("{}", config.render_table());
                println!("\n{}", config.auth_summary());
                if let Err(error) = felix_broker::security(&config) {
                    println!("{:#}", anyhow::Error::from(error));
                }
                match felix_broker::core_plan(&config) {
                    Ok(plan) => print!("\n{}", plan.render()),
                    Err(error) => println!("\ncore plan: {:#}", anyhow::Error::from(error)),
                }
            }
            Ok(())
        }
        Command::Cert { out, names, force } => run_cert(&out, names, force),
        Command::Token { file, command, .. } => run_token(&config, file, command),
        Command::Log { command, .. } => log_commands::run(&config, command),
        Command::Cluster { command, .. } => cluster_commands::run(&config, command),
        Command::Tune {
            command: Some(TuneCommand::Listeners { args, .. }),
            ..
        } => listener_sweep::run(&config, &args),
        Command::Tune { args, .. } => {
            anyhow::ensure!(
                host_commands::tune(&config, &args)?,
                "a required host setting is off"
            );
            Ok(())
        }
        Command::Preflight { args, .. } => {
            anyhow::ensure!(
                host_commands::preflight(&config, &args)?,
                "a preflight check failed"
            );
            Ok(())
        }
        Command::Stream { command, .. } => {
            client_commands::block_on(client_commands::stream(&config, command))
        }
        Command::Pub { args, .. } => {
            client_commands::block_on(client_commands::publish(&config, args))
        }
        Command::Sub { args, .. } => {
            client_commands::block_on(client_commands::subscribe(&config, args))
        }
        Command::Completions { .. } | Command::Man => unreachable!("handled above"),
    }
}

fn init_logging(config: &Config) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log)
        .with_context(|| format!("FELIX_LOG={:?} is not a valid log filter", config.log))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    Ok(())
}

fn run_broker(config: &Config) -> anyhow::Result<()> {
    host_commands::log_host_settings(config);
    let broker = Broker::start(config).context("cannot start the broker")?;
    let trigger = broker.shutdown_trigger();
    let tokens = broker.token_reloader();
    // Install the handlers before announcing the ports, so a supervisor that signals right
    // after reading them gets a clean shutdown.
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("felix-signals".to_owned())
        .spawn(move || {
            match wait_for_signal(&ready_tx, &tokens) {
                Ok(signal) => tracing::info!(signal, "shutting down"),
                Err(error) => tracing::error!(%error, "signal handling failed; shutting down"),
            }
            trigger.trigger();
        })
        .context("cannot start the signal thread")?;
    // The thread reports once the handlers are installed (or failed).
    let _ = ready_rx.recv();
    print!("{}", broker.plan().render());
    println!("felix: quic max mtu {}", broker.mtu());
    for core in broker.core_reports() {
        let allowed: Vec<String> = core.allowed_cpus.iter().map(ToString::to_string).collect();
        println!(
            "felix: core {} pinned to cpu {} allowed {}",
            core.index,
            core.cpu,
            allowed.join(",")
        );
        println!(
            "felix: core {} udp buffers recv {} send {} (kernel-reported)",
            core.index, core.recv_buffer_bytes, core.send_buffer_bytes
        );
        println!(
            "felix: core {} shared listeners {}",
            core.index,
            core.shared_addrs.len()
        );
        println!("felix: core {} listening on {}", core.index, core.own_addr);
    }
    println!("felix: quic listening on {}", broker.quic_addr());
    if let Some(addr) = broker.metrics_addr() {
        println!("felix: metrics listening on {addr}");
    }
    broker.wait().context("the broker stopped with an error")?;
    Ok(())
}

/// Waits for SIGINT or SIGTERM (returns the signal's name); each SIGHUP meanwhile re-reads
/// the tokens file (an unreadable file keeps the tokens in force and says why).
fn wait_for_signal(
    ready: &std::sync::mpsc::SyncSender<()>,
    tokens: &felix_broker::TokenReloader,
) -> std::io::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let registered = signal(SignalKind::terminate()).and_then(|terminate| {
            Ok((
                terminate,
                signal(SignalKind::interrupt())?,
                signal(SignalKind::hangup())?,
            ))
        });
        let _ = ready.send(());
        let (mut terminate, mut interrupt, mut hangup) = registered?;
        loop {
            tokio::select! {
                _ = terminate.recv() => return Ok("SIGTERM"),
                _ = interrupt.recv() => return Ok("SIGINT"),
                _ = hangup.recv() => match tokens.reload() {
                    Ok(count) => tracing::info!(tokens = count, "SIGHUP: tokens file re-read"),
                    Err(error) => tracing::error!(
                        error = %felix_storage::ErrorChain(&error),
                        "SIGHUP: cannot re-read the tokens file; the tokens in force stay"
                    ),
                },
            }
        }
    })
}

/// `felix token add|list|revoke`: the tokens file of `--file`, else FELIX_TOKENS_FILE.
fn run_token(config: &Config, file: Option<PathBuf>, command: TokenCommand) -> anyhow::Result<()> {
    let Some(path) = file.or_else(|| config.tokens_file.clone()) else {
        anyhow::bail!("no tokens file: set FELIX_TOKENS_FILE or pass --file");
    };
    match command {
        TokenCommand::Add { principal } => {
            let principal = felix_auth::Principal::new(&principal)?;
            let token = felix_auth::generate_token(&principal)?;
            felix_auth::append_token(&path, &token)?;
            println!("{}", token.token);
            eprintln!(
                "felix: token {} for {} added to {}: it is shown once, store it now; \
                 send SIGHUP to the broker to load it (systemctl reload felix)",
                token.id,
                principal,
                path.display()
            );
        }
        TokenCommand::List => {
            let file = felix_auth::TokenFile::load(&path)?;
            println!("{:<16}  PRINCIPAL", "ID");
            for entry in &file.entries {
                println!("{:<16}  {}", entry.id, entry.principal);
            }
        }
        TokenCommand::Revoke { id_or_principal } => {
            let removed = felix_auth::revoke_tokens(&path, &id_or_principal)?;
            anyhow::ensure!(
                removed > 0,
                "no token with id or principal {id_or_principal:?} in {}",
                path.display()
            );
            println!(
                "removed {removed} token(s) from {}; send SIGHUP to the broker to apply \
                 (systemctl reload felix): their connections are closed",
                path.display()
            );
        }
    }
    Ok(())
}

fn run_cert(out: &std::path::Path, names: Vec<String>, force: bool) -> anyhow::Result<()> {
    let names = if names.is_empty() {
        felix_broker::DEV_CERT_NAMES
            .iter()
            .map(|name| (*name).to_owned())
            .collect()
    } else {
        names
    };
    let cert = out.join("cert.pem");
    let key = out.join("key.pem");
    if !force {
        for path in [&cert, &key] {
            anyhow::ensure!(
                !path.exists(),
                "{} already exists (use --force to overwrite)",
                path.display()
            );
        }
    }
    let pair = felix_broker::generate_self_signed(&names)?;
    felix_broker::write_pair(&pair, &cert, &key)?;
    println!(
        "wrote {} and {} (key mode 0600)",
        cert.display(),
        key.display()
    );
    println!("valid for: {}", names.join(", "));
    println!(
        "broker: FELIX_TLS_CERT={} FELIX_TLS_KEY={}; clients: FELIX_CA={}",
        cert.display(),
        key.display(),
        cert.display()
    );
    Ok(())
}
