//! The fabric conformance suite, instantiated for every backend built here.
//!
//! Each backend gets a module with one test per check in `checks.rs`; the checks and their
//! assertions are identical for every backend.

mod checks;

macro_rules! conformance_suite {
    ($module:ident, $fabric:expr, emulated) => {
        conformance_suite!(
            $module,
            $fabric,
            [
                a_message_longer_than_the_limit_is_refused,
                a_stopped_responder_reports_what_it_did_not_run
            ]
        );
    };
    ($module:ident, $fabric:expr) => {
        conformance_suite!($module, $fabric, []);
    };
    ($module:ident, $fabric:expr, [$($extra:ident),*]) => {
        mod $module {
            use crate::checks;
            use rdkv_fabric::Backend;

            const FABRIC: Backend = $fabric;

            // Checks of the emulated providers only (`docs/fabric.md`, *Conformance*).
            conformance_suite!(@checks $($extra),*);

            conformance_suite!(@checks
                queue_pair_states_and_gauges,
                completion_queue_capacity_bounds_its_send_queues,
                read_write_round_trips,
                compare_and_swap_returns_original,
                read_after_compare_and_swap_in_one_list_sees_it,
                fetch_and_add_returns_original,
                batch_with_only_last_signaled_gives_one_completion,
                out_of_bounds_is_remote_access_error,
                unknown_rkey_is_remote_access_error,
                write_to_read_only_region_is_remote_access_error,
                misaligned_atomic_is_remote_invalid_request,
                unregistered_local_buffer_is_local_protection_error,
                deregistered_region_rkey_is_rejected,
                memory_window_is_bound_to_one_queue_pair,
                deallocated_window_rkey_is_rejected,
                error_with_requests_in_flight_flushes_them,
                vanished_peer_is_retry_exceeded,
                a_post_dropped_before_its_doorbell_still_runs,
                concurrent_fetch_add_is_exact,
                concurrent_compare_and_swap_increments_are_exact,
                reads_racing_compare_and_swap_never_tear,
                send_queue_depth_is_enforced,
                a_list_runs_inside_its_post_only_where_the_provider_completes_there,
                direct_access_runs_only_where_memory_is_shared,
            );
        }
    };
    (@checks $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                checks::$check(FABRIC).await;
            }
        )*
    };
}

conformance_suite!(soft, Backend::Soft, emulated);
conformance_suite!(loopback, Backend::Loopback, emulated);
conformance_suite!(shm, Backend::Shm, emulated);
#[cfg(feature = "verbs")]
conformance_suite!(verbs, Backend::Verbs);
