fn main() -> std::process::ExitCode {
    dflash_worker::main()
}
