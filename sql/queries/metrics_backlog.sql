-- The backlog gauges (internal/metrics), read by each process every
-- METRICS_INTERVAL, or less often while a read takes more than a 20th of it
-- (internal/service's backlogDuty), never per scrape. No parameters. Returns one row per
-- target topic and state: the target (NULL for rejected records that named
-- none), the state, its message count and how many of those are pending and
-- past their due time; and, repeated on every row:
--   - how many seconds ago the earliest due key head became due (0 if none
--     is due);
--   - how many keys are backing off after retriable publish failures;
--   - the age in seconds of the oldest open transaction in this database
--     that holds a snapshot: while it is open, vacuum cannot remove the rows
--     deleted since it began, and the queue tables (every row deleted once
--     published) bloat. It sees other users' sessions only with
--     pg_read_all_stats (or as superuser);
--   - how many keys are held by a parked message (deferred_key.held): they
--     wait for an operator to replay or delete that message;
--   - how many parked messages wait for their dead-letter copy to be
--     acknowledged;
--   - how many rows deferred_inflight holds (keys republished that their
--     consumer group has not committed past yet), and how many seconds ago
--     the oldest was published (0 if none).
-- With no message at all it returns one row whose target and state are NULL
-- and counts 0.
--
-- The oldest due head counts leased heads too: a key backing off from a
-- broker that is down is leased to no one but blocked, and it is exactly the
-- lateness to see. Heads of rate-limited targets count as well: a limit that
-- cannot keep up with its backlog is lateness. Heads of paused targets do not:
-- an operator's pause is not lateness to alert on. Keys held by a parked
-- message are never due (next_run_at 'infinity') and have their own count.
-- The oldest due head is the first entry of deferred_key_due (heads neither
-- paused nor limited; the check of target_control skips one left unflagged
-- by a race with a pause, see migration 0002, and is written as in
-- dispatch_claim.sql) or the first of some rate-limited target in
-- deferred_key_throttled: a few index entries, however large a paused or
-- limited target's backlog. The held keys are the 'infinity' end of each
-- target's range of deferred_key_target_due (a held head is never
-- throttled; deferred_key_due stops short of 'infinity', see migration
-- 0009), found with the claim's loose scan of the targets (deferred_key_target). The keys
-- backing off are read from the partial index deferred_key_failing
-- (migration 0010): a few entries. The counts read all of
-- deferred_message, which is why this runs on an interval.
WITH counts AS (
    SELECT target_topic, state, count(*) AS messages,
           count(*) FILTER (WHERE state = 'pending' AND next_run_at <= now()) AS due
    FROM deferred_message
    GROUP BY target_topic, state
), keys AS (
    SELECT coalesce(extract(epoch FROM now() - least(
               (SELECT min(k.next_run_at) FROM deferred_key k
                WHERE NOT k.throttled AND k.next_run_at <= now() AND k.next_run_at < 'infinity'
                  AND k.head_target <> ALL (ARRAY(SELECT c.target_topic FROM target_control c WHERE c.paused))),
               (SELECT min(f.next_run_at)
                FROM target_control c
                CROSS JOIN LATERAL (
                    SELECT k.next_run_at FROM deferred_key k
                    WHERE k.throttled AND k.head_target = c.target_topic AND k.next_run_at <= now()
                    ORDER BY k.next_run_at
                    LIMIT 1
                ) f
                WHERE c.rate_limit IS NOT NULL AND NOT c.paused))),
           0)::float8 AS oldest_due,
           (SELECT count(*) FROM deferred_key WHERE failures > 0 AND leased_until > now()) AS held_keys,
           coalesce((SELECT extract(epoch FROM max(now() - xact_start)) FROM pg_stat_activity
                     WHERE datname = current_database() AND backend_type = 'client backend'
                       AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
                       AND pid <> pg_backend_pid()), 0)::float8 AS oldest_xact,
           (SELECT count(*)
            FROM deferred_key_target t
            CROSS JOIN LATERAL (
                SELECT 1 FROM deferred_key k
                WHERE NOT k.throttled AND k.head_target = t.target AND k.next_run_at = 'infinity' AND k.held
            ) h) AS held_parked,
           (SELECT count(*) FROM deferred_message
            WHERE state = 'parked' AND dlq_topic IS NOT NULL AND dlq_published_at IS NULL) AS dlq_unsent,
           (SELECT count(*) FROM deferred_inflight) AS inflight_keys,
           coalesce((SELECT extract(epoch FROM now() - min(published_at)) FROM deferred_inflight), 0)::float8
               AS inflight_oldest
)
SELECT c.target_topic, c.state, coalesce(c.messages, 0) AS messages, coalesce(c.due, 0) AS due, k.oldest_due, k.held_keys, k.oldest_xact,
       k.held_parked, k.dlq_unsent, k.inflight_keys, k.inflight_oldest
FROM keys k
LEFT JOIN counts c ON true
