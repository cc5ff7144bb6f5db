-- How long until the earliest head that no one holds is due, in seconds by
-- the database clock (0 if already due; no row if nothing is pending).
-- Measured by the database so that clock skew between hosts cannot make a
-- dispatcher sleep past a due time. Walks deferred_key_due from the start,
-- skipping only leased heads.
SELECT greatest(extract(epoch FROM next_run_at - clock_timestamp()), 0)::float8
FROM deferred_key
WHERE (leased_until IS NULL OR leased_until <= now())
  AND NOT EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = head_target AND c.paused)
ORDER BY next_run_at
LIMIT 1
