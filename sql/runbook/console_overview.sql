-- console_overview.sql: each target topic at a glance, as the console's
-- overview shows it.
--
-- What: one row per target topic that has messages, a control
-- (target_control) or deliveries within :'window' (an interval: '5 minutes'):
-- its pending messages and how many of them are due, its due key heads and
-- the oldest of their due times (lateness: a head due long ago that has not
-- gone out; heads of a paused target wait on purpose), its parked and
-- rejected messages, whether it is paused (and why) or rate-limited, its
-- weight in the claims' turns (weight_target.sql; 1: the default), and how
-- many messages were delivered to it (deferred_attempt 'published' events)
-- within :'window'. target_topic is empty for records rejected before they
-- named one. Counting every pending row takes seconds on many millions of
-- rows, so the pending and due-pending counts are exact only while the
-- table's statistics (pg_class.reltuples) say it holds at most 20,000 rows;
-- above that they are estimated from a sample of about 20,000 rows
-- (TABLESAMPLE SYSTEM, whole pages) and estimated is true: a target with
-- few pending messages may then show none. Everything else is exact and
-- reads indexes: due heads (deferred_key_due, deferred_key_throttled),
-- parked and rejected (deferred_message_not_pending), the recent end of the
-- history (a BRIN index).
-- When: the first look: what flows, what is late, what is stuck.
-- Call:
--   psql "$DATABASE_URL" -v window='5 minutes' -f sql/runbook/console_overview.sql
WITH sample AS (
    -- The share of the table's pages to read, in percent: 100 (every row,
    -- exact) up to 20,000 rows. reltuples is -1 before the first ANALYZE.
    -- 20,000 rows: about 0.1 s on a table of a million; a target with
    -- thousands of messages is counted within a few percent.
    SELECT least(100, 2000000 / greatest(reltuples, 1))::float4 AS percent
    FROM pg_class
    WHERE oid = 'deferred_message'::regclass
), pending AS (
    SELECT target_topic,
           round(count(*) * 100 / (SELECT percent FROM sample))::bigint AS pending,
           round(count(*) FILTER (WHERE next_run_at <= now()) * 100 / (SELECT percent FROM sample))::bigint AS due
    FROM deferred_message TABLESAMPLE SYSTEM ((SELECT percent FROM sample))
    WHERE state = 'pending'
    GROUP BY 1
), heads AS (
    -- Both partial indexes of deferred_key hold every head between them.
    SELECT target_topic, sum(due_heads)::bigint AS due_heads, min(oldest_due) AS oldest_due
    FROM (SELECT head_target AS target_topic, count(*) AS due_heads, min(next_run_at) AS oldest_due
          FROM deferred_key
          WHERE NOT throttled AND next_run_at <= now() AND next_run_at < 'infinity'
          GROUP BY 1
          UNION ALL
          SELECT head_target, count(*), min(next_run_at)
          FROM deferred_key
          WHERE throttled AND next_run_at <= now()
          GROUP BY 1) both_kinds
    GROUP BY 1
), stopped AS (
    SELECT target_topic,
           count(*) FILTER (WHERE state = 'parked') AS parked,
           count(*) FILTER (WHERE state = 'rejected') AS rejected
    FROM deferred_message
    WHERE state <> 'pending'
    GROUP BY 1
), published AS (
    SELECT target_topic, count(*) AS published
    FROM deferred_attempt
    WHERE event = 'published'
      AND recorded_at > now() - :'window'::interval
    GROUP BY 1
), topics AS (
    -- No topic is named '' (Kafka refuses it): '' stands for "no target",
    -- NULL or empty, and the joins below are plain equalities, which can
    -- be hashed (IS NOT DISTINCT FROM made them nested loops: 30 ms with
    -- two hundred targets).
    SELECT coalesce(target_topic, '') AS target_topic FROM pending
    UNION SELECT coalesce(target_topic, '') FROM heads
    UNION SELECT coalesce(target_topic, '') FROM stopped
    UNION SELECT coalesce(target_topic, '') FROM published
    UNION SELECT target_topic FROM target_control
)
SELECT nullif(t.target_topic, '') AS target_topic,
       coalesce(p.pending, 0) AS pending,
       coalesce(p.due, 0) AS due,
       coalesce(h.due_heads, 0) AS due_heads,
       h.oldest_due,
       coalesce(extract(epoch FROM now() - h.oldest_due), 0)::float8 AS lateness_seconds,
       coalesce(s.parked, 0) AS parked,
       coalesce(s.rejected, 0) AS rejected,
       coalesce(c.paused, false) AS paused,
       c.note,
       c.rate_limit,
       coalesce(pub.published, 0) AS published,
       (SELECT percent < 100 FROM sample) AS estimated,
       coalesce(c.weight, 1) AS weight
FROM topics t
LEFT JOIN pending p ON coalesce(p.target_topic, '') = t.target_topic
LEFT JOIN heads h ON coalesce(h.target_topic, '') = t.target_topic
LEFT JOIN stopped s ON coalesce(s.target_topic, '') = t.target_topic
LEFT JOIN published pub ON coalesce(pub.target_topic, '') = t.target_topic
LEFT JOIN target_control c ON c.target_topic = t.target_topic
ORDER BY t.target_topic;
