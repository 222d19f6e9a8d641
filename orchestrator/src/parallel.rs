//! Two-way parallelism for the CPU-bound steps (planning, parsing): the machines this runs on
//! have few cores to spare, and these steps split in two without coordination.

/// Runs `a` here and `b` on a scoped helper thread (or here too, after `a`, when no thread can be
/// started), and returns both results.
pub fn both<A, B, RA, RB>(a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA,
    B: FnOnce() -> RB + Send,
    RB: Send,
{
    let slot = std::sync::Mutex::new(Some(b));
    let take = || slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("dflash-orch-helper".into())
            .spawn_scoped(scope, || take().map(|b| b()));
        let ra = a();
        let rb = match helper {
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            Err(_) => None,
        };
        (
            ra,
            rb.unwrap_or_else(|| take().expect("helper closure not run")()),
        )
    })
}

/// `f` applied to every item, the second half on a helper thread; results in item order.
pub fn map_halves<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let (lo, hi) = items.split_at(items.len() / 2);
    let (mut a, b) = both(
        || lo.iter().map(&f).collect::<Vec<R>>(),
        || hi.iter().map(&f).collect::<Vec<R>>(),
    );
    a.extend(b);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_runs_both_sides() {
        assert_eq!(both(|| 1, || 2), (1, 2));
    }

    #[test]
    fn map_halves_keeps_order() {
        let items: Vec<u32> = (0..1001).collect();
        assert_eq!(
            map_halves(&items, |x| x * 2),
            items.iter().map(|x| x * 2).collect::<Vec<_>>()
        );
        assert!(map_halves(&[] as &[u32], |x| *x).is_empty());
    }
}
