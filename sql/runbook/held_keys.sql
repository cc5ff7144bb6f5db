-- held_keys.sql: business keys whose head cannot move right now.
--
-- What: deferred_key rows whose head is stuck, one of three kinds:
--   parked       the head is a parked message that holds its key (its retry
--                policy says so, the default): nothing of the key moves until
--                an operator replays (replay.sql) or cancels (cancel_id.sql)
--                it. reason and parked_at are the parked message's.
--   backing_off  retriable publish failures (failures > 0); the key retries
--                by itself at leased_until. Fix the cause (usually the broker
--                or the target topic) and it resumes; expediting does not lift
--                the back-off.
--   leased       a dispatcher holds it (leased_until in the future, leased_by
--                names it). A lease for a publish in progress lasts
--                milliseconds; one that stays means a slow or stuck publish,
--                and one left by a crashed process expires after
--                LEASE_DURATION.
--   in_flight    leased 'in-flight': the scheduler republished a message of
--                the key that named a consumer group, which has not committed
--                past it yet (deferred_inflight); the key moves on about a
--                second after it does. One that stays means a group that
--                stopped committing: inflight.sql names it, and
--                release_inflight.sql lets its keys go. Its leased_until
--                ('infinity') is shown empty. head_id 0: no message waits.
-- With the head message of each: id, seq, target, due time (empty for a
-- parked head: it never comes due), attempt and error class, and how many
-- pending messages of the key wait behind it. Unordered messages appear with
-- an empty business_key (never as parked: they hold no key). Parked heads
-- first, oldest first; at most :'limit' rows (empty: all of them), and in
-- each row held_total, how many keys are held in all. It reads all of
-- deferred_key; the waiting count is made for the rows returned only (one
-- index probe each), so a page of the first few is fast however many keys
-- are held. `scheduler held` runs this file; `scheduler status` counts it;
-- the console's overview shows the first rows.
-- When: oldest_due.sql shows lateness, or one business key is not moving.
-- Call:
--   psql "$DATABASE_URL" -v limit= -f sql/runbook/held_keys.sql
SELECT h.business_key, h.kind, h.why, h.failures, h.leased_until, h.leased_by, h.head_id, h.head_seq,
       h.target_topic, h.next_run_at, h.attempt, h.error_class, h.reason, h.parked_at, h.held_total,
       (SELECT count(*) FROM deferred_message w
        WHERE w.business_key = h.business_key AND w.state = 'pending' AND w.id <> h.head_id) AS waiting
FROM (
    SELECT k.business_key,
           CASE WHEN k.held THEN 'parked'
                WHEN k.failures > 0 THEN 'backing_off'
                WHEN k.leased_by = 'in-flight' THEN 'in_flight'
                ELSE 'leased'
           END AS kind,
           CASE WHEN k.held THEN 'held by parked message ' || k.head_id
                WHEN k.failures > 0 THEN 'backing off after ' || k.failures || ' failed publish(es)'
                WHEN k.leased_by = 'in-flight' THEN 'waiting for its consumer group to commit past the republished record'
                ELSE 'leased by ' || coalesce(k.leased_by, 'no one')
           END AS why,
           k.failures,
           CASE WHEN k.leased_until < 'infinity' THEN k.leased_until END AS leased_until,
           k.leased_by,
           k.head_id,
           m.seq AS head_seq,
           m.target_topic,
           -- A held head's next_run_at is 'infinity', which means "never",
           -- and which many clients cannot represent.
           CASE WHEN NOT k.held THEN k.next_run_at END AS next_run_at,
           m.attempt,
           m.error_class,
           CASE WHEN k.held THEN m.reason END AS reason,
           CASE WHEN k.held THEN m.parked_at END AS parked_at,
           count(*) OVER () AS held_total,
           row_number() OVER (ORDER BY k.held DESC, m.parked_at, k.failures DESC, k.next_run_at, k.head_id) AS place
    FROM deferred_key k
    LEFT JOIN deferred_message m ON m.id = k.head_id
    WHERE k.held OR k.failures > 0 OR k.leased_until > now()
    ORDER BY place
    LIMIT nullif(:'limit', '')::bigint
) h
ORDER BY h.place;
