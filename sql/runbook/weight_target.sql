-- weight_target.sql: give one target topic a larger (or the default) share
-- of each claim while other targets have a backlog too.
--
-- What: sets the weight of :'target' in target_control to :'weight' (a
-- whole number from 1 to 100; 1 is the default, which every target without
-- a row has) and prints the row. A claim shares its round between the
-- targets that have due heads turn by turn; each turn takes as many of a
-- target's heads as its weight, so with weights 3 and 1 two backlogs drain
-- at 3 to 1. A target alone still gets every round, and one whose heads
-- run out leaves the rest to the others: a weight never holds anything
-- back (a rate limit does, limit_target.sql). Dispatchers read it at their
-- next claim. Per-key order is untouched. Set 1 again to undo. Nothing
-- is printed when the target already has that weight.
-- When: two services' retries drain at once (after a shared outage) and
-- one of them matters more, or its backlog is the one to clear first.
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -v weight=3 -f sql/runbook/weight_target.sql
WITH changed AS (
    UPDATE target_control
    SET weight = :'weight'::int, updated_at = now()
    WHERE target_topic = :'target' AND weight <> :'weight'::int
    RETURNING *
), added AS (
    -- A target without a row has weight 1 already: a row is added only
    -- for another weight.
    INSERT INTO target_control AS c (target_topic, weight)
    SELECT :'target', :'weight'::int
    WHERE :'weight'::int <> 1 AND NOT EXISTS (SELECT FROM target_control WHERE target_topic = :'target')
    ON CONFLICT (target_topic) DO UPDATE SET weight = excluded.weight, updated_at = now()
    RETURNING *
)
-- changed_by and changed_at: who made this change (the actor the history
-- records: scheduler.actor, else the psql user), and when.
SELECT target_topic, paused, rate_limit, weight, note, updated_at,
       coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text) AS changed_by,
       now() AS changed_at
FROM (SELECT * FROM changed UNION ALL SELECT * FROM added) c;
