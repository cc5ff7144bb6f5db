-- key_state.sql: why one business key is not moving.
--
-- What: the deferred_key row of business key :'key' (exact), if it has one
-- (a key has one while it has pending messages or is held): its head
-- message, whether a parked head holds it (held), its consecutive failed
-- publishes (failures: it backs off), who leases it and until when
-- (leased_by 'in-flight': the scheduler republished a message of the key
-- for a consumer group that has not committed past it yet; inflight.sql
-- names the group), the head's due time (empty when held), whether it
-- waits for its target's pause or rate limit (throttled), and the target's
-- controls (paused and why, rate limit). No row: nothing of the key waits.
-- When: one key is not moving and you want to know why before acting.
-- Call:
--   psql "$DATABASE_URL" -v key=order-42 -f sql/runbook/key_state.sql
SELECT k.business_key,
       k.head_id,
       k.held,
       k.failures,
       CASE WHEN k.leased_until < 'infinity' THEN k.leased_until END AS leased_until,
       coalesce(k.leased_until > now(), false) AS leased,
       k.leased_by,
       CASE WHEN NOT k.held THEN k.next_run_at END AS next_run_at,
       k.throttled,
       k.head_target,
       coalesce(c.paused, false) AS target_paused,
       c.rate_limit AS target_rate_limit,
       c.note AS target_note
FROM deferred_key k
LEFT JOIN target_control c ON c.target_topic = k.head_target
WHERE k.business_key = :'key';
