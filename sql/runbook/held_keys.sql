-- held_keys.sql: business keys whose head cannot move right now.
--
-- What: deferred_key rows that back off after retriable publish failures
-- (failures > 0; they retry by themselves at leased_until) or that a
-- dispatcher holds (leased_until in the future, leased_by names it), with the
-- head message of each: its id, seq, target, due time, attempt and error
-- class. Every later message of such a key waits. A lease held for a publish
-- in progress lasts milliseconds; one that stays means a slow or stuck publish,
-- and one left by a crashed process expires after LEASE_DURATION. Unordered
-- messages appear with an empty business_key.
-- A parked message releases its key today; once parked heads hold their key
-- (retry policies, issue 3) they belong in this list too.
-- When: oldest_due.sql shows lateness, or one business key is not moving.
-- Expediting a held key does not lift its back-off; fix the cause (usually
-- the broker or the target topic) and it resumes.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/held_keys.sql
SELECT k.business_key,
       CASE WHEN k.failures > 0
            THEN 'backing off after ' || k.failures || ' failed publish(es)'
            ELSE 'leased by ' || coalesce(k.leased_by, 'no one')
       END AS why,
       k.failures,
       k.leased_until,
       k.leased_by,
       k.head_id,
       m.seq AS head_seq,
       m.target_topic,
       k.next_run_at,
       m.attempt,
       m.error_class
FROM deferred_key k
LEFT JOIN deferred_message m ON m.id = k.head_id
WHERE k.failures > 0 OR k.leased_until > now()
ORDER BY k.failures DESC, k.next_run_at, k.head_id;
