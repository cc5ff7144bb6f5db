-- oldest_due.sql: how late dispatch is.
--
-- What: one row: the number of due key heads (messages that could go out
-- now), and the oldest of them: its id, business key, target, due time and
-- lateness (now minus its due time, also in seconds). Only heads count: a
-- message behind its key's head is not late, it is waiting its turn. With
-- nothing due, the counts are 0 and the rest is empty.
-- Then why due messages wait (a due pending message that is not a due head
-- goes out later than its due time, each counted once, first cause first):
--   due_messages       pending messages whose next_run_at has passed
--   waiting_paused     their target is paused (pause_target.sql)
--   waiting_parked     their key is held by a parked message (held_keys.sql)
--   waiting_in_flight  their key waits for a consumer group's commit
--                      (inflight.sql)
--   waiting_behind     behind an earlier message of their key, not due yet
--                      or itself waiting
--   waiting_rate_limited  their head waits for its target's rate limit
--   waiting_backing_off   their key backs off after failed publishes
--   waiting_leased     a dispatcher is publishing their key right now
-- It reads every due pending message: fine for a status screen.
-- When: a healthy scheduler keeps the lateness under a second or so. Minutes
-- mean dispatch is behind (too few loops, a slow broker) or keys are held
-- (see held_keys.sql). `scheduler status` shows it.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/oldest_due.sql
WITH due AS (
    SELECT CASE
               WHEN EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = m.target_topic AND c.paused) THEN 'paused'
               WHEN k.held THEN 'parked'
               WHEN k.leased_by = 'in-flight' AND k.leased_until > now() THEN 'in_flight'
               WHEN k.head_id IS DISTINCT FROM m.id THEN 'behind'
               WHEN k.throttled THEN 'rate_limited'
               WHEN k.failures > 0 THEN 'backing_off'
               WHEN k.leased_until > now() THEN 'leased'
           END AS why
    FROM deferred_message m
    LEFT JOIN LATERAL (
        SELECT * FROM deferred_key k WHERE k.business_key = m.business_key
        UNION ALL
        SELECT * FROM deferred_key k WHERE m.business_key IS NULL AND k.head_id = m.id
        LIMIT 1
    ) k ON true
    WHERE m.state = 'pending' AND m.next_run_at <= now()
), waits AS (
    SELECT count(*) AS due_messages,
           count(*) FILTER (WHERE why = 'paused') AS waiting_paused,
           count(*) FILTER (WHERE why = 'parked') AS waiting_parked,
           count(*) FILTER (WHERE why = 'in_flight') AS waiting_in_flight,
           count(*) FILTER (WHERE why = 'behind') AS waiting_behind,
           count(*) FILTER (WHERE why = 'rate_limited') AS waiting_rate_limited,
           count(*) FILTER (WHERE why = 'backing_off') AS waiting_backing_off,
           count(*) FILTER (WHERE why = 'leased') AS waiting_leased
    FROM due
)
SELECT (SELECT count(*) FROM deferred_key WHERE next_run_at <= now()) AS due_heads,
       o.head_id AS id,
       o.business_key,
       m.target_topic,
       o.next_run_at AS due_at,
       date_trunc('second', now() - o.next_run_at) AS lateness,
       coalesce(extract(epoch FROM now() - o.next_run_at), 0)::float8 AS lateness_seconds,
       w.*
FROM waits w
LEFT JOIN LATERAL (
    SELECT head_id, business_key, next_run_at
    FROM deferred_key
    WHERE next_run_at <= now()
      -- Paused targets wait on purpose (pause_target.sql); they are not late.
      AND NOT EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = head_target AND c.paused)
    ORDER BY next_run_at, head_id
    LIMIT 1
) o ON true
LEFT JOIN deferred_message m ON m.id = o.head_id;
