-- Discard dispatch loop jobs ($1 is their kind) that River believes running
-- on a process whose heartbeat is older than $2: the process is gone, and
-- the slot's uniqueness would otherwise keep a replacement from being
-- inserted until River's rescuer acts. A loop holds no state of its own (keys
-- are protected by their leases), so discarding its job loses nothing.
UPDATE river_job j
SET state = 'discarded', finalized_at = now()
WHERE j.kind = $1 AND j.state = 'running'
  AND NOT EXISTS (
      SELECT 1 FROM scheduler_instance i
      WHERE i.id = j.attempted_by[cardinality(j.attempted_by)]
        AND i.heartbeat_at > now() - $2::interval)
RETURNING j.id, j.attempted_by[cardinality(j.attempted_by)]
