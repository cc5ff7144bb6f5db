-- oldest_due.sql: how late dispatch is.
--
-- What: one row: the number of due key heads (messages that could go out
-- now), and the oldest of them: its id, business key, target, due time and
-- lateness (now minus its due time, also in seconds). Only heads count: a
-- message behind its key's head is not late, it is waiting its turn. With
-- nothing due, the counts are 0 and the rest is empty.
-- When: a healthy scheduler keeps the lateness under a second or so. Minutes
-- mean dispatch is behind (too few loops, a slow broker) or keys are held
-- (see held_keys.sql). `scheduler status` shows it.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/oldest_due.sql
SELECT (SELECT count(*) FROM deferred_key WHERE next_run_at <= now()) AS due_heads,
       o.head_id AS id,
       o.business_key,
       m.target_topic,
       o.next_run_at AS due_at,
       date_trunc('second', now() - o.next_run_at) AS lateness,
       coalesce(extract(epoch FROM now() - o.next_run_at), 0)::float8 AS lateness_seconds
FROM (SELECT 1) AS one
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
