-- Discard dispatch loop jobs ($1 is their kind) that River believes running
-- where no loop runs them:
--
-- * on a process whose heartbeat is older than $2: the process is gone;
-- * on this process ($3, its River client id), attempted more than $4 ago,
--   and not among the jobs it runs ($5): a database that went back in time
--   (a failover to a lagging replica, a restore) brings back the running
--   rows of loop runs that have ended since, and this process, alive, would
--   never be taken for gone. $4 spares a job River fetched an instant ago
--   whose loop has not started yet.
--
-- The slot's uniqueness would otherwise keep a replacement from being
-- inserted until River's rescuer acts. A loop holds no state of its own (keys
-- are protected by their leases), so discarding its job loses nothing.
-- Returns each job discarded, the process it was on, and whether it was this
-- one's.
UPDATE river_job j
SET state = 'discarded', finalized_at = now()
WHERE j.kind = $1 AND j.state = 'running'
  AND (NOT EXISTS (
           SELECT 1 FROM scheduler_instance i
           WHERE i.id = j.attempted_by[cardinality(j.attempted_by)]
             AND i.heartbeat_at > now() - $2::interval)
       OR (j.attempted_by[cardinality(j.attempted_by)] = $3::text
           AND j.attempted_at < now() - $4::interval
           AND j.id <> ALL ($5::bigint[])))
RETURNING j.id, j.attempted_by[cardinality(j.attempted_by)] AS holder,
          j.attempted_by[cardinality(j.attempted_by)] = $3::text AS ours
