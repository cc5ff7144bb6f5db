-- The backlog gauges (internal/metrics), read by each process every
-- METRICS_INTERVAL, never per scrape. No parameters. Returns one row per
-- target topic and state: the target (NULL for rejected records that named
-- none), the state, its message count and how many of those are pending and
-- past their due time; and, repeated on every row, how many seconds ago the
-- earliest due key head became due (0 if none is due) and how many keys are
-- held (backing off after retriable publish failures), and the age in
-- seconds of the oldest open transaction in this database that holds a
-- snapshot: while it is open, vacuum cannot remove the rows deleted since it
-- began, and the queue tables (every row deleted once published) bloat. It
-- sees other users' sessions only with pg_read_all_stats (or as superuser).
-- With no message at all it returns one row whose target and state are NULL
-- and counts 0.
--
-- The oldest due head counts leased heads too: a key backing off from a
-- broker that is down is leased to no one but blocked, and it is exactly the
-- lateness to see. min() over deferred_key_due reads one index entry. The
-- counts read all of deferred_message, which is why this runs on an interval.
WITH counts AS (
    SELECT target_topic, state, count(*) AS messages,
           count(*) FILTER (WHERE state = 'pending' AND next_run_at <= now()) AS due
    FROM deferred_message
    GROUP BY target_topic, state
), keys AS (
    SELECT coalesce((SELECT extract(epoch FROM now() - min(next_run_at))
                     FROM deferred_key
                     WHERE next_run_at <= now()
                       -- An operator's pause is not lateness to alert on.
                       AND NOT EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = head_target AND c.paused)),
                    0)::float8 AS oldest_due,
           (SELECT count(*) FROM deferred_key WHERE failures > 0 AND leased_until > now()) AS held_keys,
           coalesce((SELECT extract(epoch FROM max(now() - xact_start)) FROM pg_stat_activity
                     WHERE datname = current_database() AND backend_type = 'client backend'
                       AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
                       AND pid <> pg_backend_pid()), 0)::float8 AS oldest_xact
)
SELECT c.target_topic, c.state, coalesce(c.messages, 0), coalesce(c.due, 0), k.oldest_due, k.held_keys, k.oldest_xact
FROM keys k
LEFT JOIN counts c ON true
