fn main() -> std::process::ExitCode {
    dflash_orch::cli::main()
}
