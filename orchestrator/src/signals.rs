//! How a command hears SIGINT, SIGTERM and SIGHUP: stop cleanly at the first, at once later.

use dflash_common::exit_code;

/// SIGINT and SIGTERM set the returned flag: the command stops cleanly at its next chance (no
/// half-written output, workers stopped). A second signal ends the process at once with 130.
pub fn watch_stop_signals() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    use std::sync::Arc;
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let code = i32::from(exit_code::INTERRUPTED);
        let _ = signal_hook::flag::register_conditional_shutdown(signal, code, Arc::clone(&flag));
        let _ = signal_hook::flag::register(signal, Arc::clone(&flag));
    }
    flag
}

/// Counts SIGINT, SIGTERM and SIGHUP (a closed terminal) for a run, which stops cleanly at the first and at once at the second
/// (the run still removes its workers and shared memory); a third ends the process where it is.
pub fn count_stop_signals() -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let signals = [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ];
    if let Ok(mut incoming) = signal_hook::iterator::Signals::new(signals) {
        let seen = std::sync::Arc::clone(&count);
        let _ = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for _ in incoming.forever() {
                    if seen.fetch_add(1, Ordering::SeqCst) + 1 >= 3 {
                        std::process::exit(i32::from(exit_code::INTERRUPTED));
                    }
                }
            });
    }
    count
}
